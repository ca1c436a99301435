"""Layer specs from a Hugging Face ``config.json``: what the KV cache of a model needs per rank.

Only the attention shape matters to kvcm, so only these fields are read:

- Multimodal wrappers (Gemma 3, Llama 4, ...) keep the language model under ``text_config``:
  its fields are read instead, and the dtype falls back to the wrapper's.
- Fields the config leaves out get the defaults of the family's transformers config class
  (``_DEFAULTS``, by ``model_type``), as ``from_pretrained`` would: e.g. the published
  Gemma-3-4B-it ``text_config`` names only hidden_size, num_hidden_layers, sliding_window and
  rope_scaling, and ``Gemma3TextConfig`` supplies 8 heads, 4 KV heads, head_dim 256, a
  5 sliding : 1 full pattern and 131072 positions; Qwen2 without ``use_sliding_window`` is
  full attention (``Qwen2Config`` defaults it to false).
- ``num_hidden_layers``; ``num_attention_heads``; ``num_key_value_heads`` (default: the attention
  heads, i.e. multi-head attention); ``head_dim`` (default ``hidden_size / num_attention_heads``).
- MLA models (DeepSeek-V2/V3 style, ``kv_lora_rank`` set) cache one latent per token:
  ``kv_lora_rank + qk_rope_head_dim`` values, key only, one head, the same on every rank.
  With a sparse-attention indexer (DeepSeek-V3.2, ``index_head_dim``) each layer also caches
  the indexer's key: one head of ``index_head_dim`` values in fp8 (e4m3) plus one fp32 scale
  per 128 of them, whatever the KV dtype (as DeepSeek's reference, vLLM and SGLang store it):
  extra buffers ``index_key`` and ``index_key_scale``.
- Sliding windows, first match wins: ``layer_types`` (``sliding_attention`` /
  ``full_attention`` per layer; ``deepseek_sparse_attention``, which transformers 5.x writes
  ``indexed_attention``, is full attention over the latent); ``sliding_window_pattern`` P
  (Gemma 3: every P-th layer is full, the others slide); ``model_type == "gemma2"`` (even
  layers slide); else ``sliding_window`` on every layer, unless ``use_sliding_window`` is
  false, and only from layer ``max_window_layers`` on when that is given (Qwen2).
- ``torch_dtype`` (or ``dtype``) picks the KV dtype unless ``kv_dtype`` overrides it.
- ``max_position_embeddings`` is the model's longest sequence: ``max_seq_len_from_hf_config``
  gives it to the service as ``max_seq_len`` unless one is given explicitly.

Hybrid models (attention plus recurrent state layers: Mamba, gated delta nets) are refused
here with an ``UnsupportedModel`` that names ``kvcm.hf_state.hybrid_layers_from_hf_config``,
which gives their attention layers and their state layers together. Read as attention only,
a hybrid's config would give one attention layer per hidden layer (published Jamba,
Nemotron-H, Qwen3-Next and Falcon-H1 configs have no per-layer kinds this function reads):
a wrong layout, not an error. A hybrid is a ``model_type`` of ``HYBRID_FAMILIES`` or a config
with a field that only recurrent layers have (``_RECURRENT_FIELDS``, e.g. Zamba2's
``layers_block_type``); a ``layer_types`` entry that is not attention is refused the same way.

Tensor parallelism divides the KV heads: 8 KV heads on 4 ranks are 2 per rank; 8 on 16 ranks
are replicated, 1 per rank. Worked example: Llama-3.1-8B (32 layers, 8 KV heads, hidden 4096
over 32 heads = head_dim 128, bf16) gives 32 key/value layers of 8 x 128 bf16, 4 KiB per
token per layer for key and value together. DeepSeek-V3.2 gives 61 key-only layers of a
576-value bf16 latent (1152 bytes) with a 128-byte fp8 index key and a 4-byte fp32 scale:
1284 bytes per token per layer.
"""

from __future__ import annotations

from typing import Any

from kvcm_client.errors import InvalidArgument, UnsupportedModel

_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32"}

#: Values one fp32 scale of the indexer's fp8 key covers (DeepSeek-V3.2's quant block).
INDEXER_QUANT_BLOCK = 128

_GEMMA3_TEXT = {  # Gemma3TextConfig
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_size": 2304,
    "sliding_window": 4096,
    "sliding_window_pattern": 6,
    "max_position_embeddings": 131072,
}
_DEEPSEEK_V3 = {  # DeepseekV3Config
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "hidden_size": 7168,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "max_position_embeddings": 4096,
}
#: transformers' defaults of the fields read here, by ``model_type``: what a config that leaves
#: a field out means. Only absent fields take them (an explicit null stays null, as in
#: transformers: Mistral-7B-v0.3's ``"sliding_window": null`` is full attention).
_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma3_text": _GEMMA3_TEXT,
    "gemma3": _GEMMA3_TEXT,  # a text_config without its own model_type
    "gemma2": {  # Gemma2Config
        "num_hidden_layers": 26,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "hidden_size": 2304,
        "sliding_window": 4096,
        "max_position_embeddings": 8192,
    },
    "llama": {  # LlamaConfig (num_key_value_heads: the attention heads)
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "hidden_size": 4096,
        "max_position_embeddings": 2048,
    },
    "mistral": {  # MistralConfig
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "hidden_size": 4096,
        "sliding_window": 4096,
        "max_position_embeddings": 4096 * 32,
    },
    "qwen2": {  # Qwen2Config
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "hidden_size": 4096,
        "use_sliding_window": False,
        "sliding_window": 4096,
        "max_window_layers": 28,
        "max_position_embeddings": 32768,
    },
    "deepseek_v3": _DEEPSEEK_V3,
    "deepseek_v32": _DEEPSEEK_V3  # DeepseekV32Config
    | {"index_head_dim": 128, "index_n_heads": 64, "max_position_embeddings": 163840},
}


#: ``model_type`` of the hybrid families ``kvcm.hf_state`` reads (its ``_KINDS``, which a test
#: checks against this): their configs go to ``hybrid_layers_from_hf_config``.
HYBRID_FAMILIES = frozenset({"falcon_h1", "granitemoehybrid", "jamba", "nemotron_h", "qwen3_next"})

#: The function that reads a hybrid's config, as error messages name it.
HYBRID_IMPORT = "kvcm.hf_state.hybrid_layers_from_hf_config"

#: Fields that describe recurrent layers (Mamba's state, a layer-kind pattern of a hybrid, a
#: gated delta net's conv): a config with one is a hybrid, also of a family kvcm does not read
#: (Zamba, Zamba2, Bamba, ...), and its attention-only reading would be wrong.
_RECURRENT_FIELDS = (
    "hybrid_override_pattern",
    "layers_block_type",
    "attn_layer_period",
    "attn_layer_indices",
    "mamba_d_state",
    "ssm_state_size",
    "linear_conv_kernel_dim",
)

#: ``layer_types`` entries of full attention over an MLA latent with a sparse-attention indexer
#: (DeepSeek-V3.2: published ``deepseek_sparse_attention``, transformers 5.x's name for it).
_INDEXED = frozenset({"deepseek_sparse_attention", "indexed_attention"})

#: Most hidden layers a config may name: a config comes over the network too (a registration),
#: and every layer becomes a spec (the largest published models have under 200).
MAX_LAYERS = 4096


def _int(cfg: dict[str, Any], key: str, maximum: int | None = None) -> int:
    value = cfg.get(key)
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or value <= 0
        or (maximum is not None and value > maximum)
    ):
        bound = "a positive int" if maximum is None else f"an int in [1, {maximum}]"
        raise InvalidArgument(
            f"model config: {key} must be {bound}, got {_shown(value)}", field=key
        )
    return value


def _optional_int(cfg: dict[str, Any], key: str) -> int | None:
    """A positive int field that may be left out, or be 0 or null for "not set"."""
    return _int(cfg, key) if cfg.get(key) else None


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 64 else text[:61] + "..."


def _text_config(config: Any) -> dict[str, Any]:
    """The language model's fields, with the family's defaults for those left out."""
    if not isinstance(config, dict):
        raise InvalidArgument("model config must be a JSON object")
    text = config.get("text_config")
    if text is None:
        cfg = dict(config)
    elif not isinstance(text, dict):
        raise InvalidArgument(
            "model config: text_config must be a JSON object", field="text_config"
        )
    else:
        cfg = dict(text)
        for key in ("model_type", "torch_dtype", "dtype"):  # wrappers keep these at the top
            if key not in cfg and key in config:
                cfg[key] = config[key]
    return _DEFAULTS.get(str(cfg.get("model_type")), {}) | cfg


def _windows(cfg: dict[str, Any], n: int) -> list[int | None]:
    window = cfg.get("sliding_window")
    types = cfg.get("layer_types")
    if types is not None:
        if not isinstance(types, list):
            raise InvalidArgument("model config: layer_types must be a list", field="layer_types")
        if len(types) != n:
            raise InvalidArgument(
                f"model config: layer_types has {len(types)} entries for {n} layers",
                field="layer_types",
            )
        out: list[int | None] = []
        for i, kind in enumerate(types):
            if kind == "full_attention" or (kind in _INDEXED and "index_head_dim" in cfg):
                out.append(None)
            elif kind == "sliding_attention":
                out.append(_int(cfg, "sliding_window"))
            else:
                raise UnsupportedModel(
                    f"model config: layer {i} is {_shown(kind)}; layers_from_hf_config "
                    "models full and sliding attention only (the state layers of a hybrid "
                    f"come from {HYBRID_IMPORT}, for model_type "
                    f"{', '.join(sorted(HYBRID_FAMILIES))})",
                    layer_id=i,
                    layer_type=_shown(kind),
                    use=HYBRID_IMPORT,
                )
        return out
    if window is None:
        return [None] * n
    window = _int(cfg, "sliding_window")
    pattern = (
        None if cfg.get("sliding_window_pattern") is None else _int(cfg, "sliding_window_pattern")
    )
    if pattern is not None:
        return [None if (i + 1) % pattern == 0 else window for i in range(n)]
    if cfg.get("model_type") == "gemma2":
        return [window if i % 2 == 0 else None for i in range(n)]
    if cfg.get("use_sliding_window") is False:
        return [None] * n
    first = (_optional_int(cfg, "max_window_layers") or 0) if "use_sliding_window" in cfg else 0
    return [window if i >= first else None for i in range(n)]


def _per_rank(kv_heads: int, tensor_parallel: int) -> int:
    if kv_heads % tensor_parallel == 0:
        return kv_heads // tensor_parallel
    if tensor_parallel % kv_heads == 0:
        return 1  # heads are replicated across ranks
    raise InvalidArgument(
        f"{kv_heads} KV heads cannot be split over tensor_parallel={tensor_parallel}",
        num_kv_heads=kv_heads,
        tensor_parallel=tensor_parallel,
    )


def _indexer(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """The extra buffers of a sparse-attention indexer's key (none without ``index_head_dim``)."""
    if "index_head_dim" not in cfg:
        return []
    dim = _int(cfg, "index_head_dim")
    if dim % INDEXER_QUANT_BLOCK:
        raise UnsupportedModel(
            f"model config: index_head_dim {dim} is not a multiple of the indexer's fp8 "
            f"quantization block ({INDEXER_QUANT_BLOCK})",
            field="index_head_dim",
        )
    return [
        {"role": "index_key", "num_heads": 1, "head_dim": dim, "dtype": "fp8_e4m3"},
        {
            "role": "index_key_scale",
            "num_heads": 1,
            "head_dim": dim // INDEXER_QUANT_BLOCK,
            "dtype": "fp32",
        },
    ]


def max_seq_len_from_hf_config(config: dict[str, Any]) -> int | None:
    """``max_position_embeddings`` (with the family's default), or None if there is none."""
    cfg = _text_config(config)
    return (
        None if cfg.get("max_position_embeddings") is None else _int(cfg, "max_position_embeddings")
    )


def _refuse_hybrid(cfg: dict[str, Any]) -> None:
    """Refuse a hybrid's config (see the module docstring): an ``UnsupportedModel`` naming the
    function that reads its state layers, or saying that kvcm reads no state of its family."""
    family = cfg.get("model_type")
    if family in HYBRID_FAMILIES:
        raise UnsupportedModel(
            f"model config: model_type {family!r} is a hybrid of attention and recurrent state "
            f"layers; {HYBRID_IMPORT} gives both lists (layers_from_hf_config gives "
            "attention layers only)",
            model_type=family,
            use=HYBRID_IMPORT,
        )
    for field in _RECURRENT_FIELDS:
        if cfg.get(field) is not None:
            raise UnsupportedModel(
                f"model config: {field} describes recurrent state layers, and model_type "
                f"{_shown(family)} is not a hybrid family kvcm reads (it reads "
                f"{', '.join(sorted(HYBRID_FAMILIES))} through {HYBRID_IMPORT})",
                field=field,
                model_type=_shown(family),
            )


def layers_from_hf_config(
    config: dict[str, Any],
    kv_dtype: str | None = None,
    tensor_parallel: int = 1,
) -> list[dict[str, Any]]:
    """LayerSpec dicts (layer ids 0..n-1) for one rank of the model ``config`` describes.

    A hybrid (attention and state layers) is an ``UnsupportedModel`` that names
    ``kvcm.hf_state.hybrid_layers_from_hf_config``: read as attention only, its layout would
    be wrong without an error.
    """
    cfg = _text_config(config)
    _refuse_hybrid(cfg)
    return _layers(cfg, kv_dtype, tensor_parallel)


def attention_layers_from_hf_config(
    config: dict[str, Any],
    kv_dtype: str | None = None,
    tensor_parallel: int = 1,
) -> list[dict[str, Any]]:
    """Every hidden layer of ``config`` read as attention, hybrid or not: what
    ``kvcm.hf_state`` picks a hybrid's attention layers from (it has dropped the fields that
    name recurrent layer kinds). Not a model's layout on its own: use
    ``layers_from_hf_config``."""
    return _layers(_text_config(config), kv_dtype, tensor_parallel)


def _layers(
    cfg: dict[str, Any], kv_dtype: str | None, tensor_parallel: int
) -> list[dict[str, Any]]:
    if tensor_parallel < 1:
        raise InvalidArgument("tensor_parallel must be >= 1", tensor_parallel=tensor_parallel)
    n = _int(cfg, "num_hidden_layers", MAX_LAYERS)
    dtype = kv_dtype or _DTYPES.get(str(cfg.get("torch_dtype") or cfg.get("dtype")), "bf16")
    windows = _windows(cfg, n)
    if cfg.get("kv_lora_rank"):
        width = _int(cfg, "kv_lora_rank") + _int(cfg, "qk_rope_head_dim")
        shape: dict[str, Any] = {"num_kv_heads": 1, "head_dim": width, "kv_factor": 1}
        if extras := _indexer(cfg):
            shape["extra_buffers"] = extras
    elif "index_head_dim" in cfg:
        raise UnsupportedModel(
            "model config: a sparse-attention indexer (index_head_dim) without an MLA latent "
            "(kv_lora_rank); kvcm models the DeepSeek-V3.2 layout only",
            field="index_head_dim",
        )
    else:
        heads = _int(cfg, "num_attention_heads")
        kv_heads = _optional_int(cfg, "num_key_value_heads") or heads
        head_dim = _optional_int(cfg, "head_dim") or _int(cfg, "hidden_size") // heads
        shape = {
            "num_kv_heads": _per_rank(kv_heads, tensor_parallel),
            "head_dim": head_dim,
            "kv_factor": 2,
        }
    return [
        {"layer_id": i, **shape, "dtype": dtype} | ({"sliding_window": w} if w is not None else {})
        for i, w in enumerate(windows)
    ]
