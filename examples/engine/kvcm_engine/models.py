"""Models for the example engine: transformers' own architectures, built from a config with
seeded random weights (nothing is downloaded).

The configs are tiny versions of real families so that CI runs them on two CPU cores in
seconds, yet each keeps what matters to the KV cache: grouped-query attention (Llama, Qwen2),
interleaved sliding-window layers with a window smaller than the prompts (Gemma 3: two sliding
layers of 16 tokens, then a full one; Mistral: every layer slides), multi-head latent
attention (DeepSeek-V3: one 40-value latent per token, key only), and a hybrid of recurrent
state and attention (Qwen3-Next: three gated delta net layers, whose conv windows and
recurrent matrices live in kvcm's state slots, then one full-attention layer). ``scale``
multiplies them for the benchmark.

Qwen3-Next is the hybrid because transformers' pure-torch gated delta net continues from a
cached state in a multi-token forward (``torch_chunk_gated_delta_rule`` takes an initial
state), so a chunked prefill after a prefix hit gives transformers' own tokens. Jamba's
pure-torch Mamba scan (``mamba_selective_scan``) starts every multi-token forward from a zero
state, so it is exact only for a prefill in one piece; so did Qwen3-Next's before the
linear-attention cache interface (``Cache.get_conv_state`` and friends, which
``KVCMCache`` answers): transformers 5.17 has neither, 5.24 (the pinned one) has both
(``hybrid_unsupported``).

Weights: transformers' initialisation under ``torch.manual_seed(seed)``, then every matrix
of two or more dimensions multiplied by a gain (``GAINS``, 5 unless a family says otherwise).
The default initialisation (std 0.02) gives near-uniform attention and flat logits; the gain
makes attention depend on the context, so a wrong key or value in the cache changes the
generated tokens (the tests check that it does). Gemma scales its embeddings by
sqrt(hidden_size) already: a gain there saturates it into repeating one token, so it keeps 1.
"""

from __future__ import annotations

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
}

#: Families with state layers (hybrids): their recurrent state lives in kvcm's state slots.
HYBRIDS = frozenset({"qwen3_next"})

#: Weight gain by family (default 5.0; see the module docstring).
GAINS = {"gemma3": 1.0}

#: Fields ``scale`` multiplies (widths); layer counts and windows stay.
_WIDTHS = ("hidden_size", "intermediate_size", "moe_intermediate_size", "kv_lora_rank")


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
    is built from these; a sidecar registers the config itself). Imports kvcm itself: the
    in-process path only."""
    from kvcm.hf_state import hybrid_layers_from_hf_config, is_hybrid
    from kvcm.model_config import layers_from_hf_config

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
    for key in ("num_attention_heads", "num_key_value_heads"):
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
