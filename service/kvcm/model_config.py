"""Layer specs from a Hugging Face ``config.json``: what the KV cache of a model needs per rank.

Only the attention shape matters to kvcm, so only these fields are read:

- ``num_hidden_layers``; ``num_attention_heads``; ``num_key_value_heads`` (default: the attention
  heads, i.e. multi-head attention); ``head_dim`` (default ``hidden_size / num_attention_heads``).
- MLA models (DeepSeek-V2/V3 style, ``kv_lora_rank`` set) cache one latent per token:
  ``kv_lora_rank + qk_rope_head_dim`` values, key only, one head, the same on every rank.
- Sliding windows, first match wins: ``layer_types`` (``sliding_attention`` /
  ``full_attention`` per layer); ``sliding_window_pattern`` P (Gemma 3: every P-th layer is
  full, the others slide); ``model_type == "gemma2"`` (even layers slide); else
  ``sliding_window`` on every layer, unless ``use_sliding_window`` is false, and only from layer
  ``max_window_layers`` on when that is given (Qwen2).
- ``torch_dtype`` (or ``dtype``) picks the KV dtype unless ``kv_dtype`` overrides it.
- Multimodal configs keep the language model under ``text_config``; that is read instead.

Tensor parallelism divides the KV heads: 8 KV heads on 4 ranks are 2 per rank; 8 on 16 ranks
are replicated, 1 per rank. Worked example: Llama-3.1-8B (32 layers, 8 KV heads, hidden 4096
over 32 heads = head_dim 128, bf16) gives 32 key/value layers of 8 x 128 bf16, 4 KiB per
token per layer for key and value together.
"""

from __future__ import annotations

from typing import Any

from kvcm_client.errors import InvalidArgument

_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32"}


class UnsupportedModel(InvalidArgument):
    """The config describes attention kvcm does not model (e.g. linear attention layers)."""

    code = "unsupported_model"


def _int(cfg: dict[str, Any], key: str) -> int:
    value = cfg.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InvalidArgument(
            f"model config: {key} must be a positive int, got {value!r}", field=key
        )
    return value


def _windows(cfg: dict[str, Any], n: int) -> list[int | None]:
    window = cfg.get("sliding_window")
    types = cfg.get("layer_types")
    if types is not None:
        if len(types) != n:
            raise InvalidArgument(
                f"model config: layer_types has {len(types)} entries for {n} layers",
                field="layer_types",
            )
        out: list[int | None] = []
        for i, kind in enumerate(types):
            if kind == "full_attention":
                out.append(None)
            elif kind == "sliding_attention":
                out.append(_int(cfg, "sliding_window"))
            else:
                raise UnsupportedModel(
                    f"model config: layer {i} is {kind!r}; kvcm models full and sliding "
                    "attention only",
                    layer_id=i,
                    layer_type=str(kind),
                )
        return out
    if window is None:
        return [None] * n
    window = _int(cfg, "sliding_window")
    pattern = cfg.get("sliding_window_pattern")
    if pattern is not None:
        return [None if (i + 1) % pattern == 0 else window for i in range(n)]
    if cfg.get("model_type") == "gemma2":
        return [window if i % 2 == 0 else None for i in range(n)]
    if cfg.get("use_sliding_window") is False:
        return [None] * n
    first = cfg.get("max_window_layers", 0) if "use_sliding_window" in cfg else 0
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


def layers_from_hf_config(
    config: dict[str, Any],
    kv_dtype: str | None = None,
    tensor_parallel: int = 1,
) -> list[dict[str, Any]]:
    """LayerSpec dicts (layer ids 0..n-1) for one rank of the model ``config`` describes."""
    if not isinstance(config, dict):
        raise InvalidArgument("model config must be a JSON object")
    cfg = config.get("text_config") or config
    if tensor_parallel < 1:
        raise InvalidArgument("tensor_parallel must be >= 1", tensor_parallel=tensor_parallel)
    n = _int(cfg, "num_hidden_layers")
    dtype = kv_dtype or _DTYPES.get(str(cfg.get("torch_dtype") or cfg.get("dtype")), "bf16")
    windows = _windows(cfg, n)
    if cfg.get("kv_lora_rank"):
        width = _int(cfg, "kv_lora_rank") + _int(cfg, "qk_rope_head_dim")
        shape: dict[str, Any] = {"num_kv_heads": 1, "head_dim": width, "kv_factor": 1}
    else:
        heads = _int(cfg, "num_attention_heads")
        kv_heads = cfg.get("num_key_value_heads") or heads
        head_dim = cfg.get("head_dim") or _int(cfg, "hidden_size") // heads
        shape = {
            "num_kv_heads": _per_rank(kv_heads, tensor_parallel),
            "head_dim": head_dim,
            "kv_factor": 2,
        }
    return [
        {"layer_id": i, **shape, "dtype": dtype} | ({"sliding_window": w} if w is not None else {})
        for i, w in enumerate(windows)
    ]
