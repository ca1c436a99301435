"""A model registration (``POST /v1/model``, ``register_model``) as a ``ManagerConfig``.

One rule for every field, lowest first: the sizing defaults of ``kvcm serve``
(``SIZING_DEFAULTS``), what the model says (an HF config's ``max_position_embeddings``), the
service's own settings (its flags; in process, the manager's device, share and budget), the
registration's fields. The device is always the service's: the process that owns the pools
picks the GPU, not a client. ``kvcm serve --layers`` and ``--model-config`` go through the
same function, so registering a model means what starting with it means.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from kvcm_client.errors import InvalidArgument, invalid_from_validation
from kvcm_client.models import ManagerConfig, ModelRegistration

from .hf_state import hybrid_layers_from_hf_config, is_hybrid
from .model_config import layers_from_hf_config, max_seq_len_from_hf_config

if TYPE_CHECKING:
    pass

#: What a registration (or ``kvcm serve``) gets for the sizing it leaves out.
SIZING_DEFAULTS: dict[str, Any] = {
    "tokens_per_block": 16,
    "max_requests": 256,
    "max_seq_len": 4096,
    "null_page": True,
}
#: The budget when neither the registration nor the service names one: 1 GiB.
DEFAULT_MEMORY_BYTES = 1 << 30
_BUDGETS = ("memory_bytes", "num_blocks")
#: Fields that shape the layers instead of the config.
_SOURCE = ("layers", "hf_config", "kv_dtype", "tensor_parallel")


def defaults_of(config: ManagerConfig) -> dict[str, Any]:
    """What a running manager lends a registration that leaves them out: its device, share,
    budget and whether it records KV events (the sizing of the new model is its own)."""
    return {
        "device": config.device,
        "share": config.share,
        "kv_events": config.kv_events,
        "memory_bytes": config.memory_bytes,
        "num_blocks": config.num_blocks,
        "host_memory_bytes": config.host_memory_bytes,
        "transfer": config.transfer,
        "transfer_name": config.transfer_name,
    }


def to_config(registration: ModelRegistration, defaults: Mapping[str, Any]) -> ManagerConfig:
    """The ``ManagerConfig`` of ``registration`` over ``defaults`` (a service's settings:
    ``device``, ``share``, a budget, and any of the registration's fields), by the rule of the
    module docstring. Raises ``InvalidArgument`` (``UnsupportedModel`` for an HF config kvcm
    cannot model) and pydantic's ``ValidationError`` for a config that breaks its rules."""
    given = registration.model_dump(exclude_none=True, exclude=set(_SOURCE))
    settings = {k: v for k, v in defaults.items() if v is not None}
    if any(key in given for key in _BUDGETS):  # the registration's budget replaces the other
        for key in _BUDGETS:
            settings.pop(key, None)
    if not any(key in settings or key in given for key in _BUDGETS):
        settings["memory_bytes"] = DEFAULT_MEMORY_BYTES
    # Options of the layers, not fields of the config.
    service_dtype = settings.pop("kv_dtype", None)
    service_ranks = settings.pop("tensor_parallel", 1)
    kv_dtype = registration.kv_dtype or service_dtype
    tensor_parallel = registration.tensor_parallel or service_ranks
    model: dict[str, Any] = {}
    if registration.hf_config is not None:
        hf = registration.hf_config
        if is_hybrid(hf):  # attention and recurrent state layers (docs/state-layers.md)
            layers, state = hybrid_layers_from_hf_config(hf, tensor_parallel, kv_dtype)
            model["state_layers"] = state
        else:
            layers = layers_from_hf_config(hf, kv_dtype, tensor_parallel)
        if (positions := max_seq_len_from_hf_config(hf)) is not None:
            model["max_seq_len"] = positions
    else:
        assert registration.layers is not None
        layers = [
            layer.model_dump() | ({"dtype": kv_dtype} if kv_dtype else {})
            for layer in registration.layers
        ]
    settings.setdefault("share", str(settings.get("device", "cpu")) == "cpu")
    return ManagerConfig.model_validate(
        {**SIZING_DEFAULTS, **model, **settings, **given, "layers": layers}
    )


def resolve(
    config: ManagerConfig | Mapping[str, Any] | None,
    fields: Mapping[str, Any],
    defaults: Mapping[str, Any],
) -> ManagerConfig:
    """What ``KVCacheManager.register_model`` was given, as a ``ManagerConfig``: a config as
    it is (its device too: in process the caller owns the manager), or keyword arguments as a
    ``ModelRegistration`` over ``defaults``. Every refusal is ``InvalidArgument``."""
    if config is not None and fields:
        raise InvalidArgument(
            "give a ManagerConfig or the registration's keyword arguments, not both",
            fields=sorted(fields),
        )
    try:
        if config is not None:
            return ManagerConfig.model_validate(config)
        return to_config(ModelRegistration.model_validate(dict(fields)), defaults)
    except ValidationError as exc:
        raise invalid_from_validation(exc.errors()) from None
