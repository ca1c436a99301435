"""Layer specs of hybrid models (attention + recurrent state) from a Hugging Face ``config.json``.

A hybrid model interleaves attention layers, which cache K/V per token, with recurrent layers
(Mamba-1, Mamba-2, gated delta nets) that keep a fixed-size state per request. kvcm needs both:
``layers`` for the paged KV pools and ``state_layers`` for the state slots
(``client/kvcm_client/state.py``). ``hybrid_layers_from_hf_config`` splits a config into the
two, with the model's real layer ids, for five families (``model_type``):

- ``jamba`` (Jamba, Jamba-1.5): layer ``i`` is attention when
  ``i % attn_layer_period == attn_layer_offset``, else Mamba-1.
- ``nemotron_h`` (Nemotron-H): as published, ``hybrid_override_pattern``, one character per
  layer: ``M`` Mamba-2, ``*`` attention, ``-`` MLP and ``E`` MoE (no cache at all). As
  transformers 5.x's ``NemotronHConfig`` saves it, ``layers_block_type`` instead, one name per
  layer (``linear_attention``, ``full_attention``, ``mlp``, ``moe``), and no
  ``num_hidden_layers`` (absent or null: the list's length is the layer count; a count that is
  given must match it). The list wins over the pattern when both are there, as in
  transformers.
- ``qwen3_next`` (Qwen3-Next): ``layer_types`` (``linear_attention`` = gated delta net,
  ``full_attention``) or, when the config leaves it out as the published one does, every
  ``full_attention_interval``-th layer is attention (``(i + 1) % interval == 0``), as
  ``Qwen3NextConfig`` derives it.
- ``granitemoehybrid`` (Granite-4.0-H): ``layer_types`` of ``mamba`` (Mamba-2) / ``attention``
  as published, ``linear_attention`` / ``full_attention`` as transformers 5.x saves them
  (``remap_legacy_layer_types``).
- ``falcon_h1`` (Falcon-H1): every layer runs attention *and* a Mamba-2 mixer side by side.
  Layer ``i``'s attention keeps id ``i``; its mixer's state gets id ``num_hidden_layers + i``
  (kvcm wants ids unique across ``layers`` and ``state_layers``; this keeps the attention ids
  the model's own and puts the state ids right after them, in the same order).

A family's config as published and as the installed transformers' config class saves it
(``save_pretrained``) give the same layers (``tests/test_hf_state.py`` reads both).

State shapes per request and per rank, as vLLM's ``MambaStateShapeCalculator``
(``vllm/model_executor/layers/mamba/mamba_utils.py``) sizes them and transformers' modeling
code fills them; buffer names ``conv`` + ``ssm`` (Mamba) or ``conv`` + ``recurrent`` (gated
delta net):

- Mamba-1 (Jamba): ``d_inner = mamba_expand * hidden_size``; ``conv [d_inner / tp,
  mamba_d_conv - 1]``, ``ssm [d_inner / tp, mamba_d_state]``.
- Mamba-2: ``d_inner`` is ``mamba_num_heads * mamba_head_dim`` (Nemotron-H),
  ``mamba_expand * hidden_size`` (Granite) or ``mamba_d_ssm`` when set, else
  ``mamba_expand * hidden_size`` (Falcon-H1), each as vLLM's model code reads it.
  ``conv [(d_inner + 2 * groups * d_state) / tp, d_conv - 1]`` and
  ``ssm [heads / tp, head_dim, d_state]``. Groups are split over the ranks with the heads;
  when ``tensor_parallel`` does not divide ``n_groups`` (only allowed for one group, as vLLM's
  ``MambaMixer2`` requires), every rank keeps a copy of the group, i.e. ``groups`` becomes
  ``tensor_parallel`` before the division (``extra_groups_for_head_shards``).
- Gated delta net (Qwen3-Next): ``key_dim = linear_num_key_heads * linear_key_head_dim``,
  ``value_dim = linear_num_value_heads * linear_value_head_dim``,
  ``conv [(2 * key_dim + value_dim) / tp, linear_conv_kernel_dim - 1]`` and
  ``recurrent [linear_num_value_heads / tp, linear_key_head_dim, linear_value_head_dim]``
  (transformers' order; vLLM's kernels store the same matrix transposed, ``[.., v, k]``: the
  same bytes and shape when the two head dims are equal, 128 and 128 in Qwen3-Next-80B).

The conv windows hold ``kernel - 1`` past inputs, as vLLM keeps them (transformers keeps the
whole kernel width), laid out ``[dim, width]`` like transformers and vLLM's "DS" layout.
Dimensions that ``tensor_parallel`` does not divide are an ``InvalidArgument`` (vLLM asserts
the same), as are missing fields: no family defaults are filled in here, every field read must
be in the config (the published configs name them all), except the ones the family derives
(``layer_types`` of Qwen3-Next, ``mamba_d_head: "auto"``, ``mamba_d_ssm: null``).

Dtypes: the conv state is in the model's dtype (``torch_dtype`` / ``dtype``, bf16 when
absent), as vLLM's ``mamba_cache_dtype="auto"`` keeps it. The SSM / recurrent state is fp32
unless ``state_dtype`` says otherwise, or the config itself pins it (``mamba_ssm_cache_dtype``,
as NVIDIA publishes it; ``mamba_ssm_dtype``, as Qwen3.5 does; ``"auto"`` there is the
model dtype, as in vLLM): it accumulates over the whole
sequence, and fp32 is what vLLM defaults Nemotron-H to ("only float32 is known to have no
accuracy issues"). vLLM's generic ``mamba_ssm_cache_dtype="auto"`` would use the model dtype
for the other families; an engine run that way passes ``state_dtype="bf16"``. Attention layers
are read as ``layers_from_hf_config`` reads them (``kv_dtype``, KV heads divided or replicated
over ranks), through ``attention_layers_from_hf_config``: ``layers_from_hf_config`` itself
refuses a hybrid and names this module's ``hybrid_layers_from_hf_config``.

Worked example: Granite-4.0-H-Tiny (40 layers, attention at 5, 15, 25 and 35; hidden 1536,
Mamba-2 with 48 heads of 64, one group, d_state 128, kernel 4; 12 attention heads, 4 KV heads,
bf16) gives 4 attention layers of 4 KV heads x 128 bf16 and 36 state layers, each
``conv (3328, 3)`` bf16 (``3072 + 2 * 1 * 128`` channels, 19,968 bytes) and
``ssm (48, 64, 128)`` fp32 (1,572,864 bytes). On 2 ranks: 2 KV heads, ``conv (1792, 3)``
(the group copied to both ranks: ``(3072 + 2 * 2 * 128) / 2``) and ``ssm (24, 64, 128)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvcm_client.errors import InvalidArgument, UnsupportedModel
from kvcm_client.state import StateBuffer, StateLayerSpec

from .model_config import MAX_LAYERS, attention_layers_from_hf_config

#: config / torch spellings of the dtypes a state buffer may have.
_STATE_DTYPES = {
    "fp32": "fp32",
    "float32": "fp32",
    "fp16": "fp16",
    "float16": "fp16",
    "half": "fp16",
    "bf16": "bf16",
    "bfloat16": "bf16",
}

#: Fields that select sliding windows or per-layer kinds in ``layers_from_hf_config``: the
#: attention layers of these families are full attention, and their ``layer_types`` name
#: recurrent kinds that function does not know.
_ATTENTION_ONLY_DROP = ("layer_types", "sliding_window", "sliding_window_pattern")

#: Nemotron-H's layer names (``layers_block_type``, transformers 5.x) and its published
#: pattern characters, as kvcm's kinds (``none``: an MLP or MoE layer, no cache).
_NEMOTRON_H_NAMES = {
    "linear_attention": "mamba",
    "full_attention": "attention",
    "mlp": "none",
    "moe": "none",
}
_NEMOTRON_H_PATTERN = {"M": "mamba", "*": "attention", "-": "none", "E": "none"}

#: Granite-4.0-H's ``layer_types``: published (``mamba`` / ``attention``) and transformers
#: 5.x's names for the same (``linear_attention`` / ``full_attention``).
_GRANITE_NAMES = {
    "mamba": "mamba",
    "attention": "attention",
    "linear_attention": "mamba",
    "full_attention": "attention",
}


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 64 else text[:61] + "..."


def _int(cfg: dict[str, Any], key: str) -> int:
    """A positive int field; missing or anything else is an ``InvalidArgument`` naming it."""
    value = cfg.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InvalidArgument(
            f"model config: {key} must be a positive int, got {_shown(value)}", field=key
        )
    return value


def _first_int(cfg: dict[str, Any], *keys: str) -> int:
    """The first of ``keys`` the config has (families renamed some fields between releases)."""
    for key in keys:
        if cfg.get(key) is not None:
            return _int(cfg, key)
    return _int(cfg, keys[0])


def _window(kernel: int, field: str) -> int:
    """Past inputs a causal conv of width ``kernel`` keeps: ``kernel - 1``, at least one."""
    if kernel < 2:
        raise InvalidArgument(
            f"model config: {field} {kernel} keeps no conv window (needs at least 2)", field=field
        )
    return kernel - 1


def _split(value: int, tensor_parallel: int, what: str) -> int:
    if value % tensor_parallel:
        raise InvalidArgument(
            f"model config: {what} ({value}) cannot be split over "
            f"tensor_parallel={tensor_parallel}",
            field=what,
            value=value,
            tensor_parallel=tensor_parallel,
        )
    return value // tensor_parallel


def _state_dtype(value: Any, field: str) -> str:
    dtype = _STATE_DTYPES.get(str(value).lower()) if isinstance(value, str) else None
    if dtype is None:
        raise InvalidArgument(
            f"{field} must be one of fp32, fp16, bf16 (or float32, float16, bfloat16), "
            f"got {_shown(value)}",
            field=field,
        )
    return dtype


def _dtypes(cfg: dict[str, Any], state_dtype: str | None) -> tuple[str, str]:
    """(conv dtype, SSM / recurrent dtype): the model's, and fp32 unless pinned."""
    model = cfg.get("torch_dtype") or cfg.get("dtype")
    conv = _STATE_DTYPES.get(str(model).lower(), "bf16") if model is not None else "bf16"
    if state_dtype is not None:
        return conv, _state_dtype(state_dtype, "state_dtype")
    for key in ("mamba_ssm_cache_dtype", "mamba_ssm_dtype"):
        if cfg.get(key) == "auto":  # vLLM's "auto": the conv state's (the model's) dtype
            return conv, conv
        if cfg.get(key) is not None:
            return conv, _state_dtype(cfg[key], key)
    return conv, "fp32"


def _mamba1(
    cfg: dict[str, Any], tp: int, conv_dtype: str, ssm_dtype: str
) -> tuple[StateBuffer, ...]:
    d_inner = _split(_int(cfg, "mamba_expand") * _int(cfg, "hidden_size"), tp, "mamba d_inner")
    return (
        StateBuffer(
            name="conv",
            shape=(d_inner, _window(_int(cfg, "mamba_d_conv"), "mamba_d_conv")),
            dtype=conv_dtype,
        ),
        StateBuffer(name="ssm", shape=(d_inner, _int(cfg, "mamba_d_state")), dtype=ssm_dtype),
    )


def _mamba2(
    *,
    tp: int,
    d_inner: int,
    heads: int,
    head_dim: int,
    groups: int,
    d_state: int,
    d_conv: int,
    conv_dtype: str,
    ssm_dtype: str,
) -> tuple[StateBuffer, ...]:
    if heads * head_dim != d_inner:
        raise InvalidArgument(
            f"model config: {heads} Mamba heads of {head_dim} do not make d_inner {d_inner}",
            heads=heads,
            head_dim=head_dim,
            d_inner=d_inner,
        )
    if groups % tp:
        if groups != 1:
            raise InvalidArgument(
                f"model config: {groups} Mamba groups cannot be split over "
                f"tensor_parallel={tp} (only one group may be replicated)",
                n_groups=groups,
                tensor_parallel=tp,
            )
        groups = tp  # one copy of the group per rank, as vLLM's extra_groups_for_head_shards
    conv_dim = _split(d_inner + 2 * groups * d_state, tp, "mamba conv_dim")
    return (
        StateBuffer(
            name="conv", shape=(conv_dim, _window(d_conv, "conv kernel")), dtype=conv_dtype
        ),
        StateBuffer(
            name="ssm",
            shape=(_split(heads, tp, "mamba heads"), head_dim, d_state),
            dtype=ssm_dtype,
        ),
    )


def _head_dim_auto(cfg: dict[str, Any], d_inner: int, heads: int) -> int:
    """``mamba_d_head``, or ``d_inner / heads`` when the config says ``"auto"`` (transformers)."""
    if cfg.get("mamba_d_head") == "auto":
        return d_inner // heads
    return _int(cfg, "mamba_d_head")


def _layer_count(cfg: dict[str, Any]) -> int:
    """``num_hidden_layers``, at most ``MAX_LAYERS`` (checked before any per-layer list)."""
    n = _int(cfg, "num_hidden_layers")
    if n > MAX_LAYERS:
        raise InvalidArgument(
            f"model config: num_hidden_layers must be at most {MAX_LAYERS}, got {n}",
            field="num_hidden_layers",
        )
    return n


def _kinds_jamba(cfg: dict[str, Any]) -> list[str]:
    n = _layer_count(cfg)
    period, offset = _int(cfg, "attn_layer_period"), cfg.get("attn_layer_offset")
    if isinstance(offset, bool) or not isinstance(offset, int) or not 0 <= offset < period:
        raise InvalidArgument(
            f"model config: attn_layer_offset must be an int in [0, {period}), "
            f"got {_shown(offset)}",
            field="attn_layer_offset",
        )
    return ["attention" if i % period == offset else "mamba" for i in range(n)]


def _kinds_nemotron_h(cfg: dict[str, Any]) -> list[str]:
    """Nemotron-H's kinds from ``layers_block_type`` (transformers 5.x; ``layer_types``, its
    alias in ``NemotronHConfig``, too) or else the published ``hybrid_override_pattern``."""
    for key in ("layers_block_type", "layer_types"):
        if cfg.get(key) is not None:
            types = cfg[key]
            if not isinstance(types, list) or not 0 < len(types) <= MAX_LAYERS:
                raise InvalidArgument(
                    f"model config: {key} must be a list of 1 to {MAX_LAYERS} layer kinds, "
                    f"got {_shown(types)}",
                    field=key,
                )
            if cfg.get("num_hidden_layers") is not None and _layer_count(cfg) != len(types):
                raise InvalidArgument(
                    f"model config: {key} has {len(types)} layers for num_hidden_layers "
                    f"{cfg['num_hidden_layers']}",
                    field=key,
                )
            return _kinds_listed(cfg, len(types), _NEMOTRON_H_NAMES, key)
    pattern = cfg.get("hybrid_override_pattern")
    if not isinstance(pattern, str):
        raise InvalidArgument(
            "model config: hybrid_override_pattern (or layers_block_type) must be given, "
            f"as a string (a list), got {_shown(pattern)}",
            field="hybrid_override_pattern",
        )
    n = _layer_count(cfg)
    if len(pattern) != n:
        raise InvalidArgument(
            f"model config: hybrid_override_pattern has {len(pattern)} layers for {n}",
            field="hybrid_override_pattern",
        )
    for i, char in enumerate(pattern):
        if char not in _NEMOTRON_H_PATTERN:
            raise UnsupportedModel(
                f"model config: layer {i} is {char!r} in hybrid_override_pattern; kvcm knows "
                "M (Mamba-2), * (attention), - (MLP) and E (MoE)",
                layer_id=i,
            )
    return [_NEMOTRON_H_PATTERN[c] for c in pattern]


def _kinds_listed(
    cfg: dict[str, Any], n: int, names: dict[str, str], key: str = "layer_types"
) -> list[str]:
    types = cfg.get(key)
    if not isinstance(types, list) or len(types) != n:
        raise InvalidArgument(
            f"model config: {key} must be a list of {n} layer kinds, got {_shown(types)}",
            field=key,
        )
    for i, kind in enumerate(types):
        if kind not in names:
            raise UnsupportedModel(
                f"model config: layer {i} is {_shown(kind)}; kvcm knows {sorted(names)} here",
                layer_id=i,
                layer_type=_shown(kind),
            )
    return [names[k] for k in types]


def _kinds_qwen3_next(cfg: dict[str, Any]) -> list[str]:
    n = _layer_count(cfg)
    if cfg.get("layer_types") is not None:
        return _kinds_listed(cfg, n, {"linear_attention": "gdn", "full_attention": "attention"})
    interval = _int(cfg, "full_attention_interval")
    return ["attention" if (i + 1) % interval == 0 else "gdn" for i in range(n)]


def _kinds_granite(cfg: dict[str, Any]) -> list[str]:
    return _kinds_listed(cfg, _layer_count(cfg), _GRANITE_NAMES)


def _kinds_falcon_h1(cfg: dict[str, Any]) -> list[str]:
    if cfg.get("attn_layer_indices") is not None:
        raise UnsupportedModel(
            "model config: Falcon-H1 with attn_layer_indices; kvcm models attention beside the "
            "mixer on every layer",
            field="attn_layer_indices",
        )
    return ["both"] * _layer_count(cfg)


#: Per family: its layers' kinds (``attention``, ``mamba``, ``gdn``, ``both`` or ``none``).
_KINDS: dict[str, Callable[[dict[str, Any]], list[str]]] = {
    "jamba": _kinds_jamba,
    "nemotron_h": _kinds_nemotron_h,
    "qwen3_next": _kinds_qwen3_next,
    "granitemoehybrid": _kinds_granite,
    "falcon_h1": _kinds_falcon_h1,
}


def _state_buffers(
    cfg: dict[str, Any], family: str, tp: int, conv_dtype: str, ssm_dtype: str
) -> tuple[StateBuffer, ...]:
    """One recurrent layer's buffers (every recurrent layer of a model has the same)."""
    if family == "jamba":
        return _mamba1(cfg, tp, conv_dtype, ssm_dtype)
    if family == "qwen3_next":
        k_heads, v_heads = _int(cfg, "linear_num_key_heads"), _int(cfg, "linear_num_value_heads")
        k_dim, v_dim = _int(cfg, "linear_key_head_dim"), _int(cfg, "linear_value_head_dim")
        kernel = _int(cfg, "linear_conv_kernel_dim")
        conv_dim = _split(2 * k_heads * k_dim + v_heads * v_dim, tp, "gated delta net conv_dim")
        return (
            StateBuffer(
                name="conv",
                shape=(conv_dim, _window(kernel, "linear_conv_kernel_dim")),
                dtype=conv_dtype,
            ),
            StateBuffer(
                name="recurrent",
                shape=(_split(v_heads, tp, "linear_num_value_heads"), k_dim, v_dim),
                dtype=ssm_dtype,
            ),
        )
    if family == "nemotron_h":
        heads = _int(cfg, "mamba_num_heads")
        head_dim = _int(cfg, "mamba_head_dim")
        d_inner = heads * head_dim
        groups = _first_int(cfg, "n_groups", "mamba_n_groups")
        d_state = _int(cfg, "ssm_state_size")
        d_conv = _first_int(cfg, "conv_kernel", "mamba_d_conv")
    else:  # granitemoehybrid, falcon_h1
        heads = _int(cfg, "mamba_n_heads")
        if family == "falcon_h1" and cfg.get("mamba_d_ssm") is not None:
            d_inner = _int(cfg, "mamba_d_ssm")
        else:
            d_inner = _int(cfg, "mamba_expand") * _int(cfg, "hidden_size")
        head_dim = _head_dim_auto(cfg, d_inner, heads)
        groups, d_state = _int(cfg, "mamba_n_groups"), _int(cfg, "mamba_d_state")
        d_conv = _int(cfg, "mamba_d_conv")
    return _mamba2(
        tp=tp,
        d_inner=d_inner,
        heads=heads,
        head_dim=head_dim,
        groups=groups,
        d_state=d_state,
        d_conv=d_conv,
        conv_dtype=conv_dtype,
        ssm_dtype=ssm_dtype,
    )


def _attention_config(cfg: dict[str, Any], n: int) -> dict[str, Any]:
    """The config ``attention_layers_from_hf_config`` reads for this family's (full)
    attention layers: ``n`` of them (Nemotron-H as transformers 5.x saves it has no
    ``num_hidden_layers``)."""
    attn = {k: v for k, v in cfg.items() if k not in _ATTENTION_ONLY_DROP}
    attn["num_hidden_layers"] = n
    if attn.get("head_dim") is None and cfg.get("attention_head_dim") is not None:
        attn["head_dim"] = cfg["attention_head_dim"]  # Nemotron-H's spelling
    return attn


def is_hybrid(config: Any) -> bool:
    """Whether ``config`` is of a hybrid family this module reads (its ``model_type``)."""
    return isinstance(config, dict) and config.get("model_type") in _KINDS


def hybrid_layers_from_hf_config(
    config: dict[str, Any],
    tensor_parallel: int = 1,
    kv_dtype: str | None = None,
    state_dtype: str | None = None,
) -> tuple[list[dict[str, Any]], list[StateLayerSpec]]:
    """(attention LayerSpec dicts, StateLayerSpecs) for one rank of a hybrid model.

    Attention dicts are those ``layers_from_hf_config`` gives an attention model, for the
    attention layers only, with their real layer ids; the state layers carry the recurrent
    layers' real ids (Falcon-H1: ``num_hidden_layers + i``, see the module docstring).
    ``state_dtype`` sets the SSM / recurrent state's dtype (default fp32, or what the config
    pins).
    """
    if not isinstance(config, dict):
        raise InvalidArgument("model config must be a JSON object")
    if (
        isinstance(tensor_parallel, bool)
        or not isinstance(tensor_parallel, int)
        or tensor_parallel < 1
    ):
        raise InvalidArgument("tensor_parallel must be >= 1", tensor_parallel=tensor_parallel)
    family = config.get("model_type")
    kinds_of = _KINDS.get(family) if isinstance(family, str) else None
    if kinds_of is None:
        raise UnsupportedModel(
            f"model config: model_type {_shown(family)} is not a hybrid family kvcm reads "
            f"({', '.join(sorted(_KINDS))})",
            model_type=_shown(family),
        )
    kinds = kinds_of(config)
    n = len(kinds)
    conv_dtype, ssm_dtype = _dtypes(config, state_dtype)
    attention_ids = [i for i, k in enumerate(kinds) if k in ("attention", "both")]
    state_ids = [
        n + i if k == "both" else i for i, k in enumerate(kinds) if k in ("mamba", "gdn", "both")
    ]
    layers: list[dict[str, Any]] = []
    if attention_ids:
        every = attention_layers_from_hf_config(
            _attention_config(config, n), kv_dtype=kv_dtype, tensor_parallel=tensor_parallel
        )
        layers = [every[i] for i in attention_ids]
    state: list[StateLayerSpec] = []
    if state_ids:
        buffers = _state_buffers(config, family, tensor_parallel, conv_dtype, ssm_dtype)
        state = [StateLayerSpec(layer_id=i, buffers=buffers) for i in state_ids]
    return layers, state
