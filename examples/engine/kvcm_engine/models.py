"""Models for the example engine: transformers' own architectures, built from a config with
seeded random weights (nothing is downloaded).

The configs are tiny versions of real families so that CI runs them on two CPU cores in
seconds, yet each keeps what matters to the KV cache: grouped-query attention (Llama, Qwen2),
interleaved sliding-window layers with a window smaller than the prompts (Gemma 3: two sliding
layers of 16 tokens, then a full one; Mistral: every layer slides), multi-head latent
attention (DeepSeek-V3: one 40-value latent per token, key only), and hybrids of recurrent
state and attention, whose conv windows and recurrent states live in kvcm's state slots:
Qwen3-Next (three gated delta net layers, then full attention), Granite-4.0-H and Nemotron-H
(Mamba-2 around an attention layer; Nemotron-H with an MLP layer, which caches nothing),
Falcon-H1 (attention and a Mamba-2 mixer side by side in every layer) and Jamba (Mamba-1
around an attention layer). ``scale`` multiplies them for the benchmark.

How the engine runs each hybrid's state is ``STATE_PATHS``. transformers' pure-torch gated
delta net and Mamba-2 (``torch_chunk_gated_delta_rule``, the chunked SSD scan) continue from
the cached state in a multi-token forward, so a chunked prefill after a prefix hit gives
transformers' own tokens. Jamba's Mamba-1 scan (``mamba_selective_scan``) starts every
multi-token forward from a zero state: the engine runs a chunk that continues a state one
token per forward, through the one-token recurrent form that reads the state
(``StatePath.scan_continues``); a chunk from position 0 (a zeroed state) stays one forward.
All of them need the linear-attention cache interface (``Cache.get_conv_state`` and friends,
which ``KVCMCache`` answers): transformers 5.17 has none, 5.24 (the pinned one) has it
(``hybrid_unsupported``).

A model with recurrent layers of any other family (Zamba2, Bamba, LFM2, a pure Mamba, ...) is
refused with ``UnsupportedFamily``, before it runs: its state path is not implemented here,
and an attention-only reading of it would generate wrong tokens or fail deep in the model.

Weights: transformers' initialisation under ``torch.manual_seed(seed)``, then every matrix
of two or more dimensions multiplied by a gain (``GAINS``, 5 unless a family says otherwise).
The default initialisation (std 0.02) gives near-uniform attention and flat logits; the gain
makes attention depend on the context, so a wrong key or value in the cache changes the
generated tokens (the tests check that it does). Gemma scales its embeddings by
sqrt(hidden_size) already: a gain there saturates it into repeating one token, so it keeps 1.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

#: Vocabulary of the tiny models; prompts draw ids from 1 .. VOCAB - 1 (0 pads).
VOCAB = 512

_COMMON: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": VOCAB,
    "max_position_embeddings": 1024,
}

#: Tiny configs by family name: ``model_type`` plus the fields that differ from ``_COMMON``.
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {"model_type": "llama", "num_hidden_layers": 2},
    "qwen2": {"model_type": "qwen2", "num_hidden_layers": 2},
    "mistral": {"model_type": "mistral", "num_hidden_layers": 2, "sliding_window": 16},
    "gemma3": {
        "model_type": "gemma3_text",
        "num_hidden_layers": 3,
        "head_dim": 16,
        "sliding_window": 16,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
    },
    "deepseek_v3": {
        "model_type": "deepseek_v3",
        "num_hidden_layers": 2,
        "num_key_value_heads": 4,
        "moe_intermediate_size": 32,
        "kv_lora_rank": 32,
        "q_lora_rank": 48,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 16,
        "v_head_dim": 16,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "n_group": 1,
        "topk_group": 1,
    },
    "qwen3_next": {
        "model_type": "qwen3_next",
        "num_hidden_layers": 4,
        "head_dim": 16,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"],
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "num_experts": 0,
    },
    # Mamba-2 (published spelling "mamba" / "attention"; the config class saves
    # "linear_attention" / "full_attention", which kvcm reads too).
    "granitemoehybrid": {
        "model_type": "granitemoehybrid",
        "num_hidden_layers": 3,
        "layer_types": ["mamba", "attention", "mamba"],
        "mamba_n_heads": 4,
        "mamba_d_head": 32,  # 4 x 32 = mamba_expand 2 x hidden 64
        "mamba_d_state": 8,
        "mamba_n_groups": 1,
        "mamba_d_conv": 4,
        "mamba_expand": 2,
        "mamba_chunk_size": 16,
        "num_local_experts": 0,
        "shared_intermediate_size": 128,
    },
    # Mamba-2, attention, Mamba-2, an MLP layer (published pattern; NemotronHConfig saves it as
    # layers_block_type with no num_hidden_layers, the spelling hf_config carries to kvcm).
    "nemotron_h": {
        "model_type": "nemotron_h",
        "hybrid_override_pattern": "M*M-",
        "head_dim": 16,
        "mamba_num_heads": 4,
        "mamba_head_dim": 32,
        "n_groups": 2,
        "ssm_state_size": 8,
        "conv_kernel": 4,
        "chunk_size": 16,
        # Its default shrinks the attention's output projection by sqrt(layers) at init: the
        # tokens then hardly depend on the keys (a zeroed key cache changed none of them).
        "rescale_prenorm_residual": False,
    },
    # Attention and a Mamba-2 mixer in each of the 2 layers (kvcm state ids 2 and 3).
    "falcon_h1": {
        "model_type": "falcon_h1",
        "num_hidden_layers": 2,
        "head_dim": 16,
        "mamba_n_heads": 4,
        "mamba_d_head": 32,
        "mamba_d_ssm": 128,
        "mamba_d_state": 8,
        "mamba_n_groups": 1,
        "mamba_d_conv": 4,
        "mamba_chunk_size": 16,
    },
    # Mamba-1, attention, Mamba-1 (attention where i % 3 == 1), no MoE.
    "jamba": {
        "model_type": "jamba",
        "num_hidden_layers": 3,
        "attn_layer_period": 3,
        "attn_layer_offset": 1,
        "num_experts": 1,
        "expert_layer_period": 1,
        "expert_layer_offset": 0,
        "mamba_d_state": 8,
        "mamba_d_conv": 4,
        "mamba_expand": 2,
        "mamba_dt_rank": 8,
    },
}


@dataclass(frozen=True, slots=True)
class StatePath:
    """How the engine runs one hybrid family's recurrent layers on kvcm's state slots."""

    mixer: str
    """The recurrent layer, for messages: gated delta net, Mamba-2 or Mamba-1."""
    scan_continues: bool = True
    """Whether transformers' multi-token forward of the layer starts from the cached state.
    When not (Mamba-1's scan starts from zeros), a chunk that continues a state runs one
    token per forward, through the one-token recurrent form, which reads the state."""
    state_ids_after_attention: bool = False
    """Falcon-H1: layer i's mixer is kvcm state layer ``num_hidden_layers + i`` (its
    attention keeps id i; ``kvcm.hf_state``); elsewhere the state layer's id is the layer's."""


#: The hybrid families whose state path the engine implements, by ``model_type``.
STATE_PATHS: dict[str, StatePath] = {
    "qwen3_next": StatePath("gated delta net"),
    "granitemoehybrid": StatePath("Mamba-2"),
    "nemotron_h": StatePath("Mamba-2"),
    "falcon_h1": StatePath("Mamba-2", state_ids_after_attention=True),
    "jamba": StatePath("Mamba-1", scan_continues=False),
}

#: Families with state layers (hybrids): their recurrent state lives in kvcm's state slots.
HYBRIDS = frozenset(STATE_PATHS)

#: Layer kinds (``layer_types`` / ``layers_block_type``) that keep no recurrent state:
#: attention, which kvcm pages, and Nemotron-H's MLP and MoE layers, which cache nothing.
_STATELESS_KINDS = frozenset(
    {"full_attention", "sliding_attention", "chunked_attention", "attention", "mlp", "moe"}
)

#: Config fields that only models with recurrent layers have (Mamba's state size, a gated
#: delta net's or a short conv's kernel, a hybrid's layer pattern).
_RECURRENT_FIELDS = (
    "mamba_d_state",
    "ssm_state_size",
    "state_size",
    "linear_conv_kernel_dim",
    "conv_L_cache",
    "hybrid_override_pattern",
    "attn_layer_period",
    "attn_layer_indices",
)


class UnsupportedFamily(ValueError):
    """A model with recurrent layers whose state path the engine does not implement: it is
    refused before it runs, instead of failing deep in the model (a ``KeyError``) or
    generating wrong tokens."""

    def __init__(self, family: Any, evidence: str) -> None:
        self.family = family
        self.evidence = evidence
        super().__init__(
            f"the example engine does not run model_type {family!r}: it has recurrent layers "
            f"({evidence}) and the engine implements the state of "
            f"{', '.join(sorted(STATE_PATHS))} only (besides attention-only models)"
        )


def recurrent_evidence(config: Mapping[str, Any]) -> str | None:
    """What in a ``config.json`` dict shows recurrent (state) layers, or None for a model of
    attention only: a layer kind that is neither attention nor a cacheless MLP / MoE, or a
    field of recurrent layers (``_RECURRENT_FIELDS``)."""
    for key in ("layer_types", "layers_block_type"):
        kinds = config.get(key)
        if isinstance(kinds, list):
            other = sorted({str(k) for k in kinds} - _STATELESS_KINDS)
            if other:
                return f"{key} has {', '.join(other)}"
    for key in _RECURRENT_FIELDS:
        if config.get(key) is not None:
            return f"{key} is set"
    return None


def state_path(config: Mapping[str, Any]) -> StatePath | None:
    """The state path of the model a ``config.json`` dict describes: None for attention only;
    ``UnsupportedFamily`` for recurrent layers of a family not in ``STATE_PATHS``."""
    family = config.get("model_type")
    if isinstance(family, str) and family in STATE_PATHS:
        return STATE_PATHS[family]
    evidence = recurrent_evidence(config)
    if evidence is not None:
        raise UnsupportedFamily(family, evidence)
    return None


#: Weight gain by family (default 5.0; see the module docstring).
GAINS = {"gemma3": 1.0}

#: Fields ``scale`` multiplies (widths); layer counts and windows stay.
_WIDTHS = (
    "hidden_size",
    "intermediate_size",
    "moe_intermediate_size",
    "kv_lora_rank",
    "shared_intermediate_size",
    "mamba_d_ssm",
)
#: Head counts ``scale`` multiplies (head dims stay): attention's and Mamba-2's.
_HEADS = ("num_attention_heads", "num_key_value_heads", "mamba_n_heads", "mamba_num_heads")


@dataclass(frozen=True, slots=True)
class BuiltModel:
    """A model and the ``config.json`` dict that describes it to kvcm."""

    family: str
    model: torch.nn.Module
    hf_config: dict[str, Any]


#: The oldest transformers the hybrid is checked with (see the module docstring).
HYBRID_TRANSFORMERS = "5.24"


def hybrid_unsupported() -> str | None:
    """Why this transformers cannot run the hybrid on kvcm's state slots, or None."""
    import transformers
    from packaging.version import Version

    if Version(transformers.__version__) >= Version(HYBRID_TRANSFORMERS):
        return None
    return (
        f"transformers {transformers.__version__} runs a gated delta net's multi-token forward "
        "from a zero state (no linear-attention cache interface): the hybrid needs "
        f"transformers >= {HYBRID_TRANSFORMERS}"
    )


def kvcm_layers(hf_config: dict[str, Any]) -> dict[str, Any]:
    """The ``layers`` (and, for a hybrid, ``state_layers``) of a ``ManagerConfig`` for a
    model's ``config.json``, as kvcm's registration of it gives them (an in-process manager
    is built from these; a sidecar registers the config itself). A model with recurrent
    layers the engine cannot run is ``UnsupportedFamily`` here already. Imports kvcm itself:
    the in-process path only."""
    from kvcm.hf_state import hybrid_layers_from_hf_config, is_hybrid
    from kvcm.model_config import layers_from_hf_config

    state_path(hf_config)
    if is_hybrid(hf_config):
        layers, state = hybrid_layers_from_hf_config(hf_config)
        return {"layers": layers, "state_layers": state}
    return {"layers": layers_from_hf_config(hf_config)}


def family_config(family: str, scale: int = 1, **overrides: Any) -> dict[str, Any]:
    """The config fields of a family, widths times ``scale`` (heads times ``scale`` too, so
    head_dim stays), with ``overrides`` on top."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; one of {sorted(FAMILIES)}")
    fields = {**_COMMON, **FAMILIES[family]}
    for key in _WIDTHS:
        if key in fields:
            fields[key] *= scale
    for key in _HEADS:
        if key in fields:
            fields[key] *= scale
    return {**fields, **overrides}


def build_model(
    family: str,
    *,
    seed: int = 0,
    scale: int = 1,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    weight_gain: float | None = None,
    **overrides: Any,
) -> BuiltModel:
    """Build ``family`` with seeded random weights, in eval mode on ``device``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = family_config(family, scale, **overrides)
    model_type = fields.pop("model_type")
    # No end-of-sequence token: every request generates exactly its max_new_tokens, with and
    # without kvcm, so the two can be compared token for token.
    config = AutoConfig.for_model(
        model_type, **fields, eos_token_id=None, bos_token_id=None, pad_token_id=0
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    if weight_gain is None:
        weight_gain = GAINS.get(family, 5.0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(weight_gain)
    model = model.to(device=device, dtype=dtype).eval()
    name = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
    hf = {**config.to_dict(), "model_type": model_type, "torch_dtype": name[dtype]}
    return BuiltModel(family, model, hf)
