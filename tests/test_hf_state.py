"""Published hybrid-model configs (tests/fixtures/models) give attention and state layers by hand.

Every expected shape is worked out in a comment from the config's fields, with the formulas of
the module docstring of ``kvcm.hf_state`` (vLLM's ``MambaStateShapeCalculator``): Mamba-1
``conv [d_inner, d_conv - 1]``, ``ssm [d_inner, d_state]``; Mamba-2
``conv [d_inner + 2 * groups * d_state, d_conv - 1]``, ``ssm [heads, head_dim, d_state]``;
gated delta net ``conv [2 * key_dim + value_dim, kernel - 1]``,
``recurrent [v_heads, k_head_dim, v_head_dim]``; everything but the kernel width divided by TP.

The fixtures keep the published config.json's architecture fields (numbers, layer kinds,
dtype): ai21labs/AI21-Jamba-1.5-Mini, nvidia/Nemotron-H-8B-Base-8K,
Qwen/Qwen3-Next-80B-A3B-Instruct, ibm-granite/granite-4.0-h-tiny (its config names no dtype:
bf16 is kvcm's default) and tiiuae/Falcon-H1-7B (Base and Instruct share the architecture).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvcm import InvalidArgument, KVCacheManager
from kvcm.hf_state import hybrid_layers_from_hf_config
from kvcm.model_config import UnsupportedModel
from kvcm_client.state import StateLayerSpec

FIXTURES = Path(__file__).parent / "fixtures" / "models"
HYBRIDS = [
    "ai21-jamba-1.5-mini.json",
    "nemotron-h-8b-base-8k.json",
    "qwen3-next-80b-a3b-instruct.json",
    "granite-4.0-h-tiny.json",
    "falcon-h1-7b.json",
]


def _config(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / name).read_text())


def _shapes(spec: StateLayerSpec) -> dict[str, tuple[tuple[int, ...], str]]:
    return {b.name: (b.shape, b.dtype) for b in spec.buffers}


def _attention(layers: list[dict[str, Any]]) -> set[tuple[int, int, str]]:
    return {(la["num_kv_heads"], la["head_dim"], la["dtype"]) for la in layers}


def test_jamba_1_5_mini_mamba1_layers_between_attention_every_8() -> None:
    attn, state = hybrid_layers_from_hf_config(_config("ai21-jamba-1.5-mini.json"))
    # attn_layer_period 8, attn_layer_offset 4 over 32 layers: i % 8 == 4.
    assert [la["layer_id"] for la in attn] == [4, 12, 20, 28]
    assert [s.layer_id for s in state] == [i for i in range(32) if i % 8 != 4]  # 28 Mamba
    # 8 KV heads of hidden 4096 / 32 heads = 128, bf16 (torch_dtype).
    assert _attention(attn) == {(8, 128, "bf16")}
    # d_inner = mamba_expand 2 * hidden 4096 = 8192; mamba_d_conv 4 - 1 = 3; mamba_d_state 16.
    assert {s.buffers for s in state} == {state[0].buffers}
    assert _shapes(state[0]) == {"conv": ((8192, 3), "bf16"), "ssm": ((8192, 16), "fp32")}
    # 8192 * 3 * 2 bytes + 8192 * 16 * 4 bytes = 49,152 + 524,288.
    assert state[0].nbytes == 573_440


def test_jamba_1_5_mini_tensor_parallel_2() -> None:
    attn, state = hybrid_layers_from_hf_config(
        _config("ai21-jamba-1.5-mini.json"), tensor_parallel=2
    )
    assert _attention(attn) == {(4, 128, "bf16")}  # 8 KV heads / 2
    # d_inner 8192 / 2 = 4096 on each rank, conv and ssm alike.
    assert _shapes(state[0]) == {"conv": ((4096, 3), "bf16"), "ssm": ((4096, 16), "fp32")}


def test_nemotron_h_8b_pattern_picks_mamba2_and_attention_skips_mlp() -> None:
    attn, state = hybrid_layers_from_hf_config(_config("nemotron-h-8b-base-8k.json"))
    # "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-": '*' at 7, 18, 29, 40.
    assert [la["layer_id"] for la in attn] == [7, 18, 29, 40]
    mamba = [0, 2, 4, 6, 9, 11, 13, 15, 17, 20, 22, 24, 26, 28, 31, 33, 35, 37, 39, 42]
    assert [s.layer_id for s in state] == [*mamba, 44, 46, 48, 50]  # 24 'M', no '-' layer
    # 8 KV heads of attention_head_dim 128.
    assert _attention(attn) == {(8, 128, "bf16")}
    # d_inner = mamba_num_heads 128 * mamba_head_dim 64 = 8192;
    # conv_dim = 8192 + 2 * n_groups 8 * ssm_state_size 128 = 10240; conv_kernel 4 - 1 = 3.
    assert state[0].buffers[0].shape == (10240, 3)
    assert state[0].buffers[1].shape == (128, 64, 128)  # n_heads 128, head_dim 64, d_state 128
    assert _shapes(state[0]) == {"conv": ((10240, 3), "bf16"), "ssm": ((128, 64, 128), "fp32")}


def test_nemotron_h_8b_tensor_parallel_2_splits_groups_with_heads() -> None:
    attn, state = hybrid_layers_from_hf_config(
        _config("nemotron-h-8b-base-8k.json"), tensor_parallel=2
    )
    assert _attention(attn) == {(4, 128, "bf16")}
    # 8 groups split evenly: (8192 + 2 * 8 * 128) / 2 = 5120; heads 128 / 2 = 64.
    assert _shapes(state[0]) == {"conv": ((5120, 3), "bf16"), "ssm": ((64, 64, 128), "fp32")}


def test_qwen3_next_80b_gated_delta_net_every_layer_but_each_fourth() -> None:
    attn, state = hybrid_layers_from_hf_config(_config("qwen3-next-80b-a3b-instruct.json"))
    # No layer_types: full_attention_interval 4 -> (i + 1) % 4 == 0 is full attention.
    assert [la["layer_id"] for la in attn] == [3, 7, 11, 15, 19, 23, 27, 31, 35, 39, 43, 47]
    assert [s.layer_id for s in state] == [i for i in range(48) if (i + 1) % 4]  # 36 GDN
    # 2 KV heads of head_dim 256.
    assert _attention(attn) == {(2, 256, "bf16")}
    # key_dim = 16 heads * 128 = 2048, value_dim = 32 heads * 128 = 4096;
    # conv_dim = 2 * 2048 + 4096 = 8192; linear_conv_kernel_dim 4 - 1 = 3.
    assert state[0].buffers[0].shape == (8192, 3)
    assert state[0].buffers[1].shape == (32, 128, 128)  # v_heads 32, k_dim 128, v_dim 128
    assert _shapes(state[0]) == {
        "conv": ((8192, 3), "bf16"),
        "recurrent": ((32, 128, 128), "fp32"),
    }
    # 8192 * 3 * 2 + 32 * 128 * 128 * 4 = 49,152 + 2,097,152.
    assert state[0].nbytes == 2_146_304


def test_qwen3_next_80b_tensor_parallel_2_and_explicit_layer_types() -> None:
    cfg = _config("qwen3-next-80b-a3b-instruct.json")
    attn, state = hybrid_layers_from_hf_config(cfg, tensor_parallel=2)
    assert _attention(attn) == {(1, 256, "bf16")}  # 2 KV heads / 2
    # conv_dim 8192 / 2 = 4096; v_heads 32 / 2 = 16.
    assert _shapes(state[0]) == {
        "conv": ((4096, 3), "bf16"),
        "recurrent": ((16, 128, 128), "fp32"),
    }
    # The same pattern spelled out, as Qwen3NextConfig derives it, gives the same layers.
    types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(48)]
    assert hybrid_layers_from_hf_config(cfg | {"layer_types": types}) == (
        hybrid_layers_from_hf_config(cfg)
    )


def test_granite_4_0_h_tiny_layer_types() -> None:
    attn, state = hybrid_layers_from_hf_config(_config("granite-4.0-h-tiny.json"))
    assert [la["layer_id"] for la in attn] == [5, 15, 25, 35]
    assert [s.layer_id for s in state] == [i for i in range(40) if i not in (5, 15, 25, 35)]
    # 4 KV heads of hidden 1536 / 12 heads = 128; no torch_dtype: bf16.
    assert _attention(attn) == {(4, 128, "bf16")}
    # d_inner = mamba_expand 2 * hidden 1536 = 3072 = 48 heads * 64;
    # conv_dim = 3072 + 2 * 1 group * d_state 128 = 3328; mamba_d_conv 4 - 1 = 3.
    assert state[0].buffers[0].shape == (3328, 3)
    assert state[0].buffers[1].shape == (48, 64, 128)  # n_heads 48, head_dim 64, d_state 128
    # 3328 * 3 * 2 + 48 * 64 * 128 * 4 = 19,968 + 1,572,864.
    assert state[0].nbytes == 1_592_832


def test_granite_4_0_h_tiny_tensor_parallel_2_replicates_the_one_group() -> None:
    attn, state = hybrid_layers_from_hf_config(
        _config("granite-4.0-h-tiny.json"), tensor_parallel=2
    )
    assert _attention(attn) == {(2, 128, "bf16")}
    # 1 group on 2 ranks: each keeps a copy, (3072 + 2 * 2 * 128) / 2 = 1792; heads 48 / 2 = 24.
    assert _shapes(state[0]) == {"conv": ((1792, 3), "bf16"), "ssm": ((24, 64, 128), "fp32")}


def test_falcon_h1_7b_attention_and_mixer_on_every_layer() -> None:
    attn, state = hybrid_layers_from_hf_config(_config("falcon-h1-7b.json"))
    # 44 layers: attention keeps ids 0..43, each layer's mixer state gets 44 + i.
    assert [la["layer_id"] for la in attn] == list(range(44))
    assert [s.layer_id for s in state] == list(range(44, 88))
    assert _attention(attn) == {(2, 128, "bf16")}  # 2 KV heads of head_dim 128
    # d_inner = mamba_d_ssm 3072 (= 24 heads * 128); conv_dim = 3072 + 2 * 1 * 256 = 3584.
    assert state[0].buffers[0].shape == (3584, 3)
    assert state[0].buffers[1].shape == (24, 128, 256)  # n_heads 24, head_dim 128, d_state 256
    # 3584 * 3 * 2 + 24 * 128 * 256 * 4 = 21,504 + 3,145,728.
    assert state[0].nbytes == 3_167_232


def test_falcon_h1_7b_tensor_parallel_2() -> None:
    attn, state = hybrid_layers_from_hf_config(_config("falcon-h1-7b.json"), tensor_parallel=2)
    assert _attention(attn) == {(1, 128, "bf16")}
    # 1 group copied to both ranks: (3072 + 2 * 2 * 256) / 2 = 2048; heads 24 / 2 = 12.
    assert _shapes(state[0]) == {"conv": ((2048, 3), "bf16"), "ssm": ((12, 128, 256), "fp32")}


def test_dtypes_state_dtype_kv_dtype_and_a_pinned_config_dtype() -> None:
    cfg = _config("nemotron-h-8b-base-8k.json")
    attn, state = hybrid_layers_from_hf_config(cfg, kv_dtype="fp8_e4m3", state_dtype="bf16")
    assert {la["dtype"] for la in attn} == {"fp8_e4m3"}
    assert _shapes(state[0]) == {"conv": ((10240, 3), "bf16"), "ssm": ((128, 64, 128), "bf16")}
    # NVIDIA's configs may pin the SSM dtype; state_dtype still wins over it.
    pinned = cfg | {"mamba_ssm_cache_dtype": "float16"}
    assert hybrid_layers_from_hf_config(pinned)[1][0].buffers[1].dtype == "fp16"
    assert hybrid_layers_from_hf_config(pinned, state_dtype="fp32")[1][0].buffers[1].dtype == (
        "fp32"
    )
    # A float32 model keeps its conv windows in float32.
    conv = hybrid_layers_from_hf_config(cfg | {"torch_dtype": "float32"})[1][0].buffers[0]
    assert conv.dtype == "fp32"
    with pytest.raises(InvalidArgument):
        hybrid_layers_from_hf_config(cfg, state_dtype="fp8")


@pytest.mark.parametrize(
    "config",
    [
        {"model_type": "llama", "num_hidden_layers": 32},
        {"model_type": "mamba2", "num_hidden_layers": 32},
        {"num_hidden_layers": 32},
    ],
)
def test_unknown_model_type_is_unsupported(config: dict[str, Any]) -> None:
    with pytest.raises(UnsupportedModel):
        hybrid_layers_from_hf_config(config)


@pytest.mark.parametrize(
    "name,field",
    [
        ("ai21-jamba-1.5-mini.json", "mamba_d_state"),
        ("ai21-jamba-1.5-mini.json", "attn_layer_period"),
        ("nemotron-h-8b-base-8k.json", "hybrid_override_pattern"),
        ("nemotron-h-8b-base-8k.json", "ssm_state_size"),
        ("qwen3-next-80b-a3b-instruct.json", "linear_num_value_heads"),
        ("qwen3-next-80b-a3b-instruct.json", "full_attention_interval"),
        ("granite-4.0-h-tiny.json", "layer_types"),
        ("granite-4.0-h-tiny.json", "mamba_n_groups"),
        ("falcon-h1-7b.json", "mamba_d_state"),
        ("falcon-h1-7b.json", "num_hidden_layers"),
    ],
)
def test_a_missing_field_is_an_invalid_argument(name: str, field: str) -> None:
    cfg = _config(name)
    del cfg[field]
    with pytest.raises(InvalidArgument) as exc:
        hybrid_layers_from_hf_config(cfg)
    assert type(exc.value) is InvalidArgument
    assert field in exc.value.message


def test_bad_values_are_refused() -> None:
    nemotron = _config("nemotron-h-8b-base-8k.json")
    pattern = nemotron["hybrid_override_pattern"]
    with pytest.raises(InvalidArgument):  # 51 characters for 52 layers
        hybrid_layers_from_hf_config(nemotron | {"hybrid_override_pattern": pattern[:-1]})
    with pytest.raises(UnsupportedModel):  # a layer kind kvcm does not know
        hybrid_layers_from_hf_config(nemotron | {"hybrid_override_pattern": "X" + pattern[1:]})
    with pytest.raises(UnsupportedModel):
        hybrid_layers_from_hf_config(
            _config("granite-4.0-h-tiny.json") | {"layer_types": ["mamba"] * 39 + ["conv"]}
        )
    # 128 Mamba heads (and 8 KV heads) do not split over 3 ranks.
    with pytest.raises(InvalidArgument):
        hybrid_layers_from_hf_config(nemotron, tensor_parallel=3)
    # 2 groups over 4 ranks: only a single group may be copied to every rank.
    with pytest.raises(InvalidArgument):
        hybrid_layers_from_hf_config(
            _config("granite-4.0-h-tiny.json") | {"mamba_n_groups": 2}, tensor_parallel=4
        )
    with pytest.raises(InvalidArgument):
        hybrid_layers_from_hf_config(nemotron, tensor_parallel=0)
    with pytest.raises(InvalidArgument):
        hybrid_layers_from_hf_config(["not", "a", "dict"])  # type: ignore[arg-type]


@pytest.mark.parametrize("name", HYBRIDS)
def test_manager_builds_from_each_fixture(name: str) -> None:
    attn, state = hybrid_layers_from_hf_config(_config(name))
    m = KVCacheManager(
        {
            "layers": attn,
            "state_layers": state,
            "num_blocks": 8,
            "max_requests": 2,
            "max_seq_len": 64,
            "tokens_per_block": 16,
            "state_checkpoints": 0,
        }
    )
    # One live slot per request (2), no checkpoints: the state bytes are two of every layer's.
    assert m.estimate(64).state_bytes == 2 * sum(s.nbytes for s in state)
    info = m.allocate("r0", 20)
    assert info.num_tokens == 20
    m.free("r0")


# -- configs as the installed transformers writes them (issue 31, item 10) ---------------------


def _saved_by_transformers(published: dict[str, Any], tmp_path: Path) -> dict[str, Any]:
    """The config.json the installed transformers' own config class writes for ``published``
    (``AutoConfig.for_model(...).save_pretrained``): its current spellings (Nemotron-H's
    ``layers_block_type`` without ``num_hidden_layers``, Granite's ``linear_attention``)."""
    transformers = pytest.importorskip("transformers")
    fields = {k: v for k, v in published.items() if k not in ("architectures", "model_type")}
    config = transformers.AutoConfig.for_model(published["model_type"], **fields)
    config.save_pretrained(tmp_path)
    return json.loads((tmp_path / "config.json").read_text())


@pytest.mark.parametrize("name", HYBRIDS)
def test_the_published_and_the_transformers_saved_config_give_the_same_layers(
    name: str, tmp_path: Path
) -> None:
    """Each family's published config.json and the one transformers' config class saves
    from it describe one model: the same layers and state layers, on 1 and 2 ranks."""
    published = _config(name)
    saved = _saved_by_transformers(published, tmp_path)
    for tp in (1, 2):
        assert hybrid_layers_from_hf_config(saved, tensor_parallel=tp) == (
            hybrid_layers_from_hf_config(published, tensor_parallel=tp)
        )


def test_nemotron_h_8b_saved_by_transformers_has_layers_block_type_and_no_layer_count(
    tmp_path: Path,
) -> None:
    saved = _saved_by_transformers(_config("nemotron-h-8b-base-8k.json"), tmp_path)
    assert saved.get("num_hidden_layers") is None and "hybrid_override_pattern" not in saved
    assert len(saved["layers_block_type"]) == 52
    attn, state = hybrid_layers_from_hf_config(saved)
    # "M-M-M-M*-...": '*' (full_attention) at 7, 18, 29, 40; 'M' (linear_attention) 24 layers.
    assert [la["layer_id"] for la in attn] == [7, 18, 29, 40]
    mamba = [0, 2, 4, 6, 9, 11, 13, 15, 17, 20, 22, 24, 26, 28, 31, 33, 35, 37, 39, 42]
    assert [s.layer_id for s in state] == [*mamba, 44, 46, 48, 50]
    assert _attention(attn) == {(8, 128, "bf16")}  # head_dim 128 (saved as head_dim)
    assert _shapes(state[0]) == {"conv": ((10240, 3), "bf16"), "ssm": ((128, 64, 128), "fp32")}
    # num_hidden_layers written as null means the same as left out.
    assert hybrid_layers_from_hf_config(saved | {"num_hidden_layers": None}) == (attn, state)


def test_a_tiny_nemotron_h_from_its_config_class_with_moe_and_mlp_layers() -> None:
    """Built with transformers' NemotronHConfig from the published pattern spelling; every
    kind: M (linear_attention), * (full_attention), - (mlp) and E (moe)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.NemotronHConfig(
        hybrid_override_pattern="M*M-ME",
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        mamba_num_heads=4,
        mamba_head_dim=32,
        n_groups=2,
        ssm_state_size=8,
        conv_kernel=4,
        dtype="bfloat16",
    ).to_dict()
    assert config["layers_block_type"] == [
        "linear_attention",
        "full_attention",
        "linear_attention",
        "mlp",
        "linear_attention",
        "moe",
    ]
    attn, state = hybrid_layers_from_hf_config(config)
    assert attn == [
        {"layer_id": 1, "num_kv_heads": 2, "head_dim": 16, "kv_factor": 2, "dtype": "bf16"}
    ]
    assert [s.layer_id for s in state] == [0, 2, 4]  # no state for the MLP and the MoE layer
    # d_inner = 4 heads * 32 = 128; conv_dim = 128 + 2 * 2 groups * 8 = 160; kernel 4 - 1.
    assert _shapes(state[0]) == {"conv": ((160, 3), "bf16"), "ssm": ((4, 32, 8), "fp32")}
    # The published spelling of the same model gives the same layers.
    pattern = {k: v for k, v in config.items() if k != "layers_block_type"}
    assert hybrid_layers_from_hf_config(
        pattern | {"hybrid_override_pattern": "M*M-ME", "num_hidden_layers": 6}
    ) == (attn, state)


def test_nemotron_h_layers_block_type_refusals() -> None:
    saved = _config("nemotron-h-8b-base-8k.json")
    pattern = saved.pop("hybrid_override_pattern")
    names = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
    saved["layers_block_type"] = [names[c] for c in pattern]
    assert len(hybrid_layers_from_hf_config(saved)[1]) == 24  # with num_hidden_layers 52 too
    with pytest.raises(InvalidArgument, match="layers_block_type has 52 layers") as exc:
        hybrid_layers_from_hf_config(saved | {"num_hidden_layers": 51})
    assert exc.value.detail["field"] == "layers_block_type"
    with pytest.raises(UnsupportedModel) as unknown:
        hybrid_layers_from_hf_config(
            saved | {"layers_block_type": ["conv", "full_attention"], "num_hidden_layers": None}
        )
    assert unknown.value.detail["layer_id"] == 0
    for bad in ("M*", [], [1] * 5000):
        with pytest.raises(InvalidArgument):
            hybrid_layers_from_hf_config(
                saved | {"layers_block_type": bad, "num_hidden_layers": None}
            )
    # Neither spelling: the error names the published field.
    del saved["layers_block_type"]
    with pytest.raises(InvalidArgument) as missing:
        hybrid_layers_from_hf_config(saved)
    assert missing.value.detail["field"] == "hybrid_override_pattern"


def test_granite_4_layer_types_as_transformers_saves_them() -> None:
    """GraniteMoeHybridConfig turns the published "mamba" / "attention" into
    "linear_attention" / "full_attention": both read the same."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GraniteMoeHybridConfig(
        hidden_size=64,
        num_hidden_layers=4,
        layer_types=["mamba", "attention", "mamba", "mamba"],
        num_attention_heads=4,
        num_key_value_heads=2,
        mamba_n_heads=4,
        mamba_d_head=32,
        mamba_d_state=8,
        mamba_n_groups=1,
        mamba_d_conv=4,
        mamba_expand=2,
    ).to_dict()
    assert config["layer_types"] == [
        "linear_attention",
        "full_attention",
        "linear_attention",
        "linear_attention",
    ]
    attn, state = hybrid_layers_from_hf_config(config)
    # hidden 64 / 4 heads = head_dim 16; no dtype: bf16.
    assert attn == [
        {"layer_id": 1, "num_kv_heads": 2, "head_dim": 16, "kv_factor": 2, "dtype": "bf16"}
    ]
    assert [s.layer_id for s in state] == [0, 2, 3]
    # d_inner = mamba_expand 2 * 64 = 128 = 4 * 32; conv_dim = 128 + 2 * 1 * 8 = 144.
    assert _shapes(state[0]) == {"conv": ((144, 3), "bf16"), "ssm": ((4, 32, 8), "fp32")}
    published = config | {"layer_types": ["mamba", "attention", "mamba", "mamba"]}
    assert hybrid_layers_from_hf_config(published) == (attn, state)
    tiny = _config("granite-4.0-h-tiny.json")
    renamed = [
        "full_attention" if t == "attention" else "linear_attention" for t in tiny["layer_types"]
    ]
    assert hybrid_layers_from_hf_config(tiny | {"layer_types": renamed}) == (
        hybrid_layers_from_hf_config(tiny)
    )


def test_the_hybrid_families_are_the_ones_layers_from_hf_config_points_here() -> None:
    """``kvcm.model_config.HYBRID_FAMILIES`` (which ``layers_from_hf_config`` refuses, naming
    this module) is exactly what this module reads."""
    from kvcm import hf_state
    from kvcm.model_config import HYBRID_FAMILIES, HYBRID_IMPORT

    assert set(hf_state._KINDS) == HYBRID_FAMILIES
    module, name = HYBRID_IMPORT.rsplit(".", 1)
    assert module == hf_state.__name__ and getattr(hf_state, name) is hybrid_layers_from_hf_config
    assert all(hf_state.is_hybrid(_config(fixture)) for fixture in HYBRIDS)
