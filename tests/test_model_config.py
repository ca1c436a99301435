"""Published Hugging Face configs (tests/fixtures/models) give the exact KV layout by hand.

Every expected number is worked out in a comment from the config's fields and the defaults
transformers fills in for the fields a config leaves out.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from kvcm import InvalidArgument, KVCacheManager
from kvcm.cli import main
from kvcm.model_config import UnsupportedModel, layers_from_hf_config, max_seq_len_from_hf_config
from kvcm.server.settings import Settings

FIXTURES = Path(__file__).parent / "fixtures" / "models"


def _config(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / name).read_text())


def _manager(name: str, **settings: Any) -> KVCacheManager:
    """The model of a fixture, small: 256-token requests, 16 slots per pool group."""
    cfg = Settings(
        hf_model_config=FIXTURES / name, num_blocks=16, max_seq_len=256, **settings
    ).manager_config()
    return KVCacheManager(cfg.model_copy(update={"share": False}))


@pytest.mark.parametrize(
    "name,max_position_embeddings",
    [
        ("gemma-3-4b-it.json", 131072),  # not in the config: Gemma3TextConfig's default
        ("qwen2.5-7b-instruct.json", 32768),
        ("mistral-7b-v0.1.json", 32768),
        ("mistral-7b-instruct-v0.3.json", 32768),
        ("deepseek-v3.2.json", 163840),
        ("llama-3.1-8b.json", 131072),
    ],
)
def test_max_seq_len_is_max_position_embeddings_unless_given(
    name: str, max_position_embeddings: int
) -> None:
    assert max_seq_len_from_hf_config(_config(name)) == max_position_embeddings
    cfg = Settings(hf_model_config=FIXTURES / name, num_blocks=4).manager_config()
    assert cfg.max_seq_len == max_position_embeddings
    explicit = Settings(hf_model_config=FIXTURES / name, num_blocks=4, max_seq_len=4096)
    assert explicit.manager_config().max_seq_len == 4096  # --max-seq-len wins


def test_gemma_3_4b_it_reads_text_config_and_transformers_defaults() -> None:
    # The published text_config names 34 layers and a 1024-token window only; Gemma3TextConfig
    # supplies 4 KV heads of head_dim 256 and sliding_window_pattern 6; bf16 is the wrapper's.
    layers = layers_from_hf_config(_config("gemma-3-4b-it.json"))
    assert len(layers) == 34
    assert {(la["num_kv_heads"], la["head_dim"], la["dtype"]) for la in layers} == {
        (4, 256, "bf16")
    }
    # Every 6th layer is full (layers 5, 11, 17, 23, 29: 5 of them), the 29 others slide.
    assert [i for i, la in enumerate(layers) if "sliding_window" not in la] == [5, 11, 17, 23, 29]
    assert {la.get("sliding_window") for la in layers} == {1024, None}
    m = _manager("gemma-3-4b-it.json")
    groups = m.describe().layer_groups
    assert [(g.sliding_window, len(g.layer_ids)) for g in groups] == [(1024, 29), (None, 5)]
    # Per layer: 4 KV heads x 256 dims x 2 (K, V) x 2 bytes (bf16) = 4096 bytes per token.
    # Sliding group: 29 x 4096 = 118,784; full group: 5 x 4096 = 20,480 (139,264 in all).
    assert m.estimate(256).bytes_per_token == {0: 118_784, 1: 20_480}
    # 58 and 10 buffers per slot: two pool groups.
    assert [pg.slot_bytes for pg in m.describe().pool_groups] == [118_784 * 16, 20_480 * 16]


def test_qwen2_5_7b_instruct_is_full_attention_everywhere() -> None:
    # use_sliding_window is false: its sliding_window 131072 and max_window_layers 28 are unused.
    m = _manager("qwen2.5-7b-instruct.json")
    groups = m.describe().layer_groups
    assert [(g.sliding_window, len(g.layer_ids)) for g in groups] == [(None, 28)]
    # hidden 3584 / 28 heads = head_dim 128; 4 KV heads:
    # 28 layers x 4 KV heads x 128 x 2 (K, V) x 2 bytes (bf16) = 57,344 bytes per token.
    assert m.estimate(256).bytes_per_token == {0: 57_344}
    # Qwen2Config defaults use_sliding_window to false: leaving it out changes nothing.
    cfg = {
        k: v for k, v in _config("qwen2.5-7b-instruct.json").items() if k != "use_sliding_window"
    }
    assert all("sliding_window" not in la for la in layers_from_hf_config(cfg))


def test_mistral_7b_v0_1_slides_everywhere_and_v0_3_does_not() -> None:
    # 32 layers x 8 KV heads x (4096 / 32 = 128) x 2 (K, V) x 2 bytes = 131,072 bytes per token.
    v01 = _manager("mistral-7b-v0.1.json")
    assert [(g.sliding_window, len(g.layer_ids)) for g in v01.describe().layer_groups] == [
        (4096, 32)
    ]
    assert v01.estimate(256).bytes_per_token == {0: 131_072}
    v03 = _manager("mistral-7b-instruct-v0.3.json")  # "sliding_window": null
    assert [(g.sliding_window, len(g.layer_ids)) for g in v03.describe().layer_groups] == [
        (None, 32)
    ]
    assert v03.estimate(256).bytes_per_token == {0: 131_072}
    # An absent sliding_window is MistralConfig's default, 4096; only an explicit null is full.
    absent = {
        k: v for k, v in _config("mistral-7b-instruct-v0.3.json").items() if k != "sliding_window"
    }
    assert {la.get("sliding_window") for la in layers_from_hf_config(absent)} == {4096}


def test_deepseek_v3_2_caches_the_latent_and_the_indexer_key() -> None:
    layers = layers_from_hf_config(_config("deepseek-v3.2.json"))
    assert len(layers) == 61
    assert layers[0] == {
        "layer_id": 0,
        "num_kv_heads": 1,
        "head_dim": 512 + 64,  # kv_lora_rank + qk_rope_head_dim
        "kv_factor": 1,
        "dtype": "bf16",
        "extra_buffers": [
            # One head of index_head_dim in fp8, one fp32 scale per 128 values.
            {"role": "index_key", "num_heads": 1, "head_dim": 128, "dtype": "fp8_e4m3"},
            {"role": "index_key_scale", "num_heads": 1, "head_dim": 1, "dtype": "fp32"},
        ],
    }
    m = _manager("deepseek-v3.2.json")
    info = m.describe()
    assert [(g.sliding_window, len(g.layer_ids)) for g in info.layer_groups] == [(None, 61)]
    # Per layer: 576 x 2 bytes (bf16 latent) + 128 x 1 (fp8 index key) + 1 x 4 (fp32 scale)
    # = 1152 + 128 + 4 = 1284 bytes; 61 layers: 78,324 bytes per token.
    assert m.estimate(256).bytes_per_token == {0: 78_324}
    # 16 tokens per block: one pool per buffer kind, 61 buffers each.
    assert [(p.num_buffers, p.bytes_per_buffer) for p in info.pools] == [
        (61, 16 * 1152),
        (61, 16 * 128),
        (61, 16 * 4),
    ]
    assert info.roles[4:] == ("index_key", "index_key_scale")
    assert m.layer_view(60, "index_key").shape == (16, 16, 1, 128)
    assert m.layer_view(60, "index_key_scale").dtype == torch.float32
    # --kv-dtype changes the latent only; the indexer stays fp8 with fp32 scales:
    # 61 x (576 + 128 + 4) = 43,188 bytes per token.
    fp8 = _manager("deepseek-v3.2.json", kv_dtype="fp8_e4m3")
    assert fp8.estimate(256).bytes_per_token == {0: 61 * 708}


def test_deepseek_v3_2_as_newer_transformers_save_it() -> None:
    # DeepseekV32Config writes layer_types "deepseek_sparse_attention" (full attention over the
    # latent); a config without the indexer fields gets DeepseekV32Config's (128 dims).
    cfg = _config("deepseek-v3.2.json")
    cfg["layer_types"] = ["deepseek_sparse_attention"] * 61
    del cfg["index_head_dim"], cfg["index_n_heads"]
    assert layers_from_hf_config(cfg) == layers_from_hf_config(_config("deepseek-v3.2.json"))


def test_the_estimate_command_counts_the_indexer(capsys: pytest.CaptureFixture[str]) -> None:
    path = str(FIXTURES / "deepseek-v3.2.json")
    # 33 slots: the null page (on for served models) and 32 blocks of 16 tokens.
    args = ["--model-config", path, "--num-blocks", "33", "--max-seq-len", "512"]
    assert main(["estimate", *args, "--seq-len", "512"]) == 0
    out = capsys.readouterr().out
    assert "78324" in out  # bytes per token of the one layer group
    assert ["512", "1", "memory", "512"] in [line.split() for line in out.splitlines()]


@pytest.mark.parametrize(
    "change,field",
    [
        ({"kv_lora_rank": None, "qk_rope_head_dim": None}, "index_head_dim"),  # no latent
        ({"index_head_dim": 96}, "index_head_dim"),  # not whole fp8 quantization blocks
    ],
)
def test_indexers_kvcm_cannot_model_are_unsupported(change: dict[str, Any], field: str) -> None:
    cfg = _config("deepseek-v3.2.json") | change
    cfg["model_type"] = "my_dsa"  # no family defaults to fill the latent back in
    with pytest.raises(UnsupportedModel) as exc:
        layers_from_hf_config(cfg)
    assert exc.value.code == "unsupported_model" and exc.value.detail["field"] == field


@pytest.mark.parametrize(
    "change,field",
    [
        ({"num_hidden_layers": 4097}, "num_hidden_layers"),  # over MAX_LAYERS
        ({"num_hidden_layers": 10**18}, "num_hidden_layers"),
        ({"sliding_window": 8, "sliding_window_pattern": 0}, "sliding_window_pattern"),
        ({"num_key_value_heads": "2"}, "num_key_value_heads"),
        ({"head_dim": 1.5}, "head_dim"),
        (
            {"sliding_window": 8, "use_sliding_window": True, "max_window_layers": "x"},
            "max_window_layers",
        ),
        ({"layer_types": "full_attention"}, "layer_types"),
    ],
)
def test_hostile_configs_are_invalid_arguments(change: dict[str, Any], field: str) -> None:
    """A config comes over the network too (POST /v1/model): fields of the wrong type or
    absurd size are refused with a field name, never a TypeError or a billion layer specs."""
    llama = {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64}
    with pytest.raises(InvalidArgument) as exc:
        layers_from_hf_config(llama | change)
    assert exc.value.detail["field"] == field


# -- hybrids and configs as the installed transformers writes them (issue 31, item 10) -------

HYBRID_FIXTURES = [
    "ai21-jamba-1.5-mini.json",
    "nemotron-h-8b-base-8k.json",
    "qwen3-next-80b-a3b-instruct.json",
    "granite-4.0-h-tiny.json",
    "falcon-h1-7b.json",
]


def _saved_by_transformers(published: dict[str, Any]) -> dict[str, Any]:
    """What the installed transformers' config class of ``published`` writes (``to_dict``)."""
    transformers = pytest.importorskip("transformers")
    fields = {k: v for k, v in published.items() if k not in ("architectures", "model_type")}
    return transformers.AutoConfig.for_model(published["model_type"], **fields).to_dict()


@pytest.mark.parametrize("name", HYBRID_FIXTURES)
def test_a_hybrid_is_refused_with_the_function_that_reads_it(name: str) -> None:
    """Read as attention only, the published Jamba, Nemotron-H, Qwen3-Next and Falcon-H1
    configs gave one attention layer per hidden layer: a wrong layout and no error. Every
    hybrid, published or as transformers saves it, is refused, naming the hybrid import."""
    published = _config(name)
    for config in (published, _saved_by_transformers(published)):
        with pytest.raises(UnsupportedModel) as exc:
            layers_from_hf_config(config)
        assert "kvcm.hf_state.hybrid_layers_from_hf_config" in exc.value.message
        assert exc.value.detail == {
            "model_type": published["model_type"],
            "use": "kvcm.hf_state.hybrid_layers_from_hf_config",
        }


def test_a_hybrid_of_a_family_kvcm_does_not_read_is_refused() -> None:
    """Zamba2 (Mamba-2 layers with shared attention blocks, ``layers_block_type``) is no
    family kvcm reads: an attention-only reading would page a KV cache for every layer."""
    transformers = pytest.importorskip("transformers")
    zamba2 = transformers.Zamba2Config(
        hidden_size=64,
        num_hidden_layers=4,
        layers_block_type=["mamba", "hybrid", "mamba", "hybrid"],
        num_attention_heads=4,
        mamba_d_state=8,
    ).to_dict()
    with pytest.raises(UnsupportedModel) as exc:
        layers_from_hf_config(zamba2)
    assert exc.value.detail == {"field": "layers_block_type", "model_type": "'zamba2'"}
    assert "not a hybrid family kvcm reads" in exc.value.message
    # A recurrent layer kind in layer_types names the hybrid import and the families it reads.
    llama = {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64}
    with pytest.raises(UnsupportedModel) as kinds:
        layers_from_hf_config(llama | {"layer_types": ["linear_attention", "full_attention"]})
    assert kinds.value.detail["layer_id"] == 0
    assert "kvcm.hf_state.hybrid_layers_from_hf_config" in kinds.value.message


def test_deepseek_v3_2_as_transformers_5_saves_it() -> None:
    """DeepseekV32Config of transformers 5.x writes layer_types "indexed_attention" (its name
    for "deepseek_sparse_attention"): the same 61 latent layers with the indexer key."""
    published = _config("deepseek-v3.2.json")
    saved = _saved_by_transformers(published)
    assert set(saved["layer_types"]) == {"indexed_attention"}
    assert layers_from_hf_config(saved) == layers_from_hf_config(published)
    # Without the indexer's fields it stays refused, as deepseek_sparse_attention is.
    plain = {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64}
    with pytest.raises(UnsupportedModel):
        layers_from_hf_config(plain | {"layer_types": ["indexed_attention"] * 2})


@pytest.mark.parametrize(
    "name",
    [
        "gemma-3-4b-it.json",
        "gemma-2-9b.json",
        "gpt-oss-20b.json",
        "llama-3.1-8b.json",
        "mistral-7b-v0.1.json",
        "mistral-7b-instruct-v0.3.json",
        "qwen2.5-7b-instruct.json",
        "deepseek-v2-lite.json",
    ],
)
def test_attention_models_read_the_same_as_transformers_saves_them(name: str) -> None:
    published = _config(name)
    assert layers_from_hf_config(_saved_by_transformers(published)) == (
        layers_from_hf_config(published)
    )
