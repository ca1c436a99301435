"""Service settings: command-line flags over ``KVCM_*`` environment variables over defaults.

The model comes from one source, first match wins: ``config`` (a JSON ``ManagerConfig``),
``layers`` (a JSON list of layer specs), ``model_config`` (a Hugging Face ``config.json``), or
the embedded default model if ``default_model`` is set. With none of them the service starts
without a model and waits for one to be registered (``POST /v1/model``): a sidecar usually
starts before its engine knows the model. The sizing flags (``memory``, ``num_blocks``,
``tokens_per_block``, ``device``, ``max_requests``, ``max_seq_len``, ``max_prefill_chunk``,
``max_lookahead``) override what that source says, and are the defaults of every registered
model too (``registration_defaults``). A Hugging Face config also sets ``max_seq_len`` to the
model's ``max_position_embeddings``; an explicit ``max_seq_len`` wins.

The service turns the null page on (``null_page``, docs/index-contract.md): the embedded default
and the ``layers`` and ``model_config`` sources have it, since the attention kernels an
inference server runs may read whole tiles of pages. A ``config`` file is a ``ManagerConfig``
and says for itself (off when it does not name it); ``--null-page`` / ``--no-null-page``
(``KVCM_NULL_PAGE``) override every source.

The bearer token is read from ``KVCM_API_TOKEN`` only (never a flag: flags show up in process
lists) and is never logged or printed.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import AliasChoices, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from kvcm_client.errors import InvalidArgument, NoModel
from kvcm_client.models import DType, ManagerConfig, ModelRegistration

from ..registration import DEFAULT_MEMORY_BYTES, SIZING_DEFAULTS, defaults_of, to_config
from .step_poll import DEFAULT_POLL_US

#: The embedded default model (``--default-model``): Llama-3-8B-like (32 full-attention layers,
#: 8 KV heads x 128, bf16) with 1 GiB of KV on the CPU, so that it serves on any machine.
DEFAULT_CONFIG: dict[str, Any] = {
    "layers": [{"layer_id": i, "num_kv_heads": 8, "head_dim": 128} for i in range(32)],
    **SIZING_DEFAULTS,
    "device": "cpu",
    "memory_bytes": DEFAULT_MEMORY_BYTES,
}
#: Settings that a registered model takes as its defaults (``registration_defaults``).
_REGISTRATION_DEFAULTS = (
    "device",
    "share",
    "tokens_per_block",
    "max_requests",
    "max_seq_len",
    "max_prefill_chunk",
    "max_lookahead",
    "null_page",
    "kv_events",
    "kv_dtype",
    "tensor_parallel",
    "num_blocks",
)

DEFAULT_PORT = 8470

_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_IUNITS = {"ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_size(text: str | int) -> int:
    """Bytes from ``"8GiB"``, ``"512MiB"``, ``"2G"``, ``"1.5GB"`` or a plain number.

    Example: "1.5GiB" is 1.5 x 2**30 = 1610612736 bytes; "2G" is 2 x 10**9.
    """
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgtKMGT]i?)?[bB]?\s*", text)
    if m is None:
        raise InvalidArgument(f"not a size: {text!r} (try 8GiB, 512MiB or a byte count)")
    unit = (m.group(2) or "").lower()
    scale = _IUNITS.get(unit) or _UNITS[unit]
    return int(float(m.group(1)) * scale)


class Settings(BaseSettings):
    """Everything ``kvcm serve`` and ``kvcm estimate`` read; env names are ``KVCM_<FIELD>``."""

    model_config = SettingsConfigDict(env_prefix="KVCM_", extra="forbid")

    # -- model source --
    config: Path | None = None
    layers: Path | None = None
    hf_model_config: Path | None = Field(
        default=None, validation_alias=AliasChoices("hf_model_config", "KVCM_MODEL_CONFIG")
    )
    default_model: bool = False
    """Serve the embedded default model (``DEFAULT_CONFIG``) when no other source is given."""
    kv_dtype: DType | None = None
    tensor_parallel: int = Field(default=1, ge=1)
    # -- sizing overrides --
    # A zero budget is refused here, so that the error names --memory (KVCM_MEMORY), not the
    # ManagerConfig field it becomes.
    memory: int | None = Field(default=None, gt=0)
    host_memory: int | None = Field(default=None, gt=0)
    """A host tier of this many bytes (``ManagerConfig.host_memory_bytes``, docs/host-tier.md)."""
    num_blocks: int | None = Field(default=None, gt=0)
    tokens_per_block: int | None = Field(default=None, gt=0)
    device: str | None = None
    max_requests: int | None = Field(default=None, gt=0)
    max_seq_len: int | None = Field(default=None, gt=0)
    max_prefill_chunk: int | None = Field(default=None, gt=0)
    max_lookahead: int | None = Field(default=None, ge=0)
    share: bool | None = None
    """Map pools and page tables into shared memory; None (auto): on for the CPU."""
    null_page: bool | None = None
    """Reserve a zeroed null page for tile-reading kernels; None: what the model source says
    (on, except in a ``config`` file that does not turn it on)."""
    kv_events: bool | None = None
    """Record KV events (``ManagerConfig.kv_events``); None: what the model source says (on,
    unless a ``config`` file turns them off). ``--no-kv-events`` for a replica no router
    follows: publishing then records nothing and ``GET /v1/events`` is ``kv_events_disabled``."""
    # -- serving --
    host: str = "127.0.0.1"
    port: int = Field(default=DEFAULT_PORT, ge=0, le=65535)
    uds: Path | None = None
    step_socket: Path | None = None
    """Also serve the step channel (docs/step-channel.md) on this Unix socket."""
    step_poll_us: float = Field(default=DEFAULT_POLL_US, ge=0, le=10_000)
    """Microseconds the step channel polls for a client's next frame after an answer, where
    the last answer to that op was followed by the next frame that soon
    (docs/step-channel.md); 0: never."""
    step_spin_s: float = Field(default=0.0, ge=0, le=60)
    """Busy-poll mode of the step channel: after each answer, poll for the next frame for
    this many seconds whatever came before, so that a step after a model pass finds the
    service awake (docs/step-channel.md, "Busy-poll mode"); it burns a core while steps keep
    coming. 0: off (the adaptive ``step_poll_us`` only)."""
    kv_events_zmq: str | None = None
    """Also publish the KV events in vLLM's format on a ZeroMQ PUB socket bound here, e.g.
    ``tcp://127.0.0.1:5557`` (docs/prefix-reuse.md#vllms-event-format; needs pyzmq)."""
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = Field(default=None, ge=0, le=65535)
    lease_ttl: float = Field(default=30.0, gt=0, le=86_400)
    request_timeout: float = Field(default=10.0, gt=0, le=3600)
    """Seconds a request may take to arrive whole, headers and body (slow clients are cut)."""
    max_body_bytes: int | None = Field(default=None, gt=0)
    """Request body limit; None: from max_seq_len (``server.app.default_body_limit``)."""
    api_token: SecretStr | None = None
    # -- KV moves between sidecars (docs/disaggregation.md) --
    transfer: Literal["nixl"] | None = None
    """A transfer endpoint (``ManagerConfig.transfer``): peers pull this sidecar's blocks
    and it pulls theirs. Needs ``KVCM_API_TOKEN`` (the transfer routes are behind it)."""
    transfer_name: str | None = None
    """This sidecar's name among its peers (``ManagerConfig.transfer_name``)."""
    peer: list[str] = []
    """The peers this sidecar may pull from, ``NAME=URL`` each: it connects to these only,
    never to an address a request names."""
    peer_token: SecretStr | None = None
    """The token of the peers' routes (``KVCM_PEER_TOKEN``; ``KVCM_PEER_TOKEN_<NAME>`` for
    one peer, read at start); env only, as ``KVCM_API_TOKEN``."""
    log_level: str = "info"
    access_log: bool = False

    @field_validator("memory", "host_memory", mode="before")
    @classmethod
    def _size(cls, value: Any) -> Any:
        return None if value is None else parse_size(value)

    @field_validator("api_token")
    @classmethod
    def _token(cls, value: SecretStr | None) -> SecretStr | None:
        # An empty or blank token would silently turn auth off: refuse to start instead.
        if value is not None and not value.get_secret_value().strip():
            raise ValueError("KVCM_API_TOKEN is set but empty: unset it, or give a token")
        return value

    @field_validator("peer")
    @classmethod
    def _peers(cls, value: list[str]) -> list[str]:
        for item in value:
            name, sep, url = item.partition("=")
            if (
                not sep
                or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name)
                or not re.match(r"https?://[^\s]+$", url)
            ):
                raise ValueError(
                    f"--peer {item!r}: give NAME=URL, e.g. prefill-0=http://10.0.0.7:8470"
                )
        return value

    @model_validator(mode="after")
    def _transfer_token(self) -> Settings:
        if self.transfer is not None and self.api_token is None:
            raise ValueError(
                "--transfer needs KVCM_API_TOKEN: the transfer routes (agent metadata, "
                "exports) are behind the token"
            )
        return self

    @model_validator(mode="after")
    def _one_budget(self) -> Settings:
        if self.memory is not None and self.num_blocks is not None:
            raise ValueError("give one of memory (KVCM_MEMORY) and num_blocks (KVCM_NUM_BLOCKS)")
        return self

    @property
    def has_model(self) -> bool:
        """Whether these settings name a model (else the service starts without one)."""
        sources = (self.config, self.layers, self.hf_model_config)
        return self.default_model or any(source is not None for source in sources)

    def registration_defaults(self, started: ManagerConfig | None = None) -> dict[str, Any]:
        """What a registered model takes from these settings where it says nothing: the
        device (always), share, the budget and the sizing flags that were given. ``started``:
        the config the service started with, whose device, share and budget are the
        service's (the flags are in it, and a ``config`` file may name its own)."""
        out = {key: getattr(self, key) for key in _REGISTRATION_DEFAULTS}
        out["memory_bytes"] = self.memory
        out["host_memory_bytes"] = self.host_memory
        out["transfer"] = self.transfer
        out["transfer_name"] = self.transfer_name
        if started is not None:
            out |= defaults_of(started)
        return out

    def peers(self) -> dict[str, tuple[str, str | None]]:
        """Each configured peer's URL and token (its own ``KVCM_PEER_TOKEN_<NAME>``, else
        ``KVCM_PEER_TOKEN``). Example: ``--peer prefill-0=http://10.0.0.7:8470`` reads
        ``KVCM_PEER_TOKEN_PREFILL_0``."""
        shared = self.peer_token.get_secret_value() if self.peer_token else None
        out = {}
        for item in self.peer:
            name, _, url = item.partition("=")
            own = os.environ.get("KVCM_PEER_TOKEN_" + re.sub(r"[^A-Za-z0-9]", "_", name).upper())
            out[name] = (url.rstrip("/"), own or shared)
        return out

    def manager_config(self) -> ManagerConfig:
        """The ``ManagerConfig`` these settings describe (validated); ``NoModel`` if they
        name no model source."""
        if self.config is not None:
            return self._config_file()
        if self.layers is not None:
            source = {"layers": _source(self.layers, "--layers")}
        elif self.hf_model_config is not None:
            source = {"hf_config": _source(self.hf_model_config, "--model-config")}
        elif self.default_model:
            source = {"layers": DEFAULT_CONFIG["layers"]}
        else:
            raise NoModel(
                "no model source: give --config, --layers, --model-config or --default-model"
            )
        return to_config(ModelRegistration.model_validate(source), self.registration_defaults())

    def _config_file(self) -> ManagerConfig:
        """A ``ManagerConfig`` file, with the flags that were given over it."""
        assert self.config is not None
        raw: dict[str, Any] = dict(_source(self.config, "--config"))
        layers = raw.get("layers")
        if self.kv_dtype is not None and isinstance(layers, list):
            # (Not a list, or not a list of objects: the validation below says so.)
            raw["layers"] = [
                {**layer, "dtype": self.kv_dtype} if isinstance(layer, dict) else layer
                for layer in layers
            ]
        for key in (
            "tokens_per_block",
            "device",
            "max_requests",
            "max_seq_len",
            "max_prefill_chunk",
            "max_lookahead",
            "null_page",
            "kv_events",
        ):
            value = getattr(self, key)
            if value is not None:
                raw[key] = value
        if self.share is not None:
            raw["share"] = self.share
        elif "share" not in raw:
            raw["share"] = str(raw.get("device", "cpu")) == "cpu"
        if self.host_memory is not None:
            raw["host_memory_bytes"] = self.host_memory
        if self.transfer is not None:
            raw["transfer"] = self.transfer
        if self.transfer_name is not None:
            raw["transfer_name"] = self.transfer_name
        if self.memory is not None:
            raw["memory_bytes"], raw["num_blocks"] = self.memory, None
        elif self.num_blocks is not None:
            raw["memory_bytes"], raw["num_blocks"] = None, self.num_blocks
        return ManagerConfig.model_validate(raw)


#: Keys only a Hugging Face ``config.json`` has (transformers writes the first two in every one).
_HF_KEYS = (
    "model_type",
    "architectures",
    "transformers_version",
    "num_hidden_layers",
    "text_config",
)
#: What each model source flag takes, for the hint of a file given to the wrong one.
_TAKES = {
    "--config": "a ManagerConfig",
    "--layers": "a list of layer specs",
    "--model-config": "a Hugging Face config.json",
}


def _kind(data: Any) -> str | None:
    """The model source flag ``data`` (a parsed JSON file) is meant for, by its shape; None
    where it does not look like any of them."""
    if isinstance(data, list):
        return "--layers"
    if isinstance(data, dict):
        if any(key in data for key in _HF_KEYS):
            return "--model-config"
        if "layers" in data:
            return "--config"
    return None


def _source(path: Path, flag: str) -> Any:
    """The JSON file given to a model source ``flag``, refused in one line that names the flag
    it belongs to where it plainly holds another source's kind (a Hugging Face config given to
    ``--config``): validated as the wrong kind, it fails field by field (a line for each of an
    HF config's keys) or with a traceback, and never says which flag was meant."""
    data = _read_json(path)
    kind = _kind(data)
    if kind is not None and kind != flag:
        raise InvalidArgument(
            f"{flag} {path} looks like {_TAKES[kind]}: give it with {kind} "
            f"({flag} takes {_TAKES[flag]})",
            path=str(path),
        )
    if flag == "--config" and not isinstance(data, dict):
        raise InvalidArgument(f"--config {path} must hold a JSON object (a ManagerConfig)")
    return data


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except OSError as exc:
        raise InvalidArgument(f"cannot read {path}: {exc.strerror}", path=str(path)) from None
    except json.JSONDecodeError as exc:
        raise InvalidArgument(f"{path} is not JSON: {exc}", path=str(path)) from None
