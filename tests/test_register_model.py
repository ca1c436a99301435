"""Registering the model at run time: ``POST /v1/model``, the clients and the manager.

A real ``kvcm serve`` started without a model waits for one (``/readyz`` 503 ``no_model``,
manager routes 503 ``no_model``); a registration checks everything first and changes nothing
when refused (``requests_live`` while requests live, ``invalid_argument``,
``insufficient_memory``, ``unsupported_model``), else builds the new model in a new generation
that other clients notice (``stale_generation``) and the registering client is pinned to.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers import layer
from servers import serve_in_thread, serve_process

from kvcm import KVCacheManager, LayerSpec
from kvcm.cli import main
from kvcm.model_config import layers_from_hf_config
from kvcm.registration import to_config
from kvcm.server.app import create_app
from kvcm.server.settings import Settings
from kvcm_client import AsyncKVCacheClient, KVCacheClient
from kvcm_client.errors import (
    InsufficientMemory,
    InvalidArgument,
    ModelWaitTimeout,
    NoModel,
    RequestsLive,
    StaleGeneration,
    UnsupportedModel,
)
from kvcm_client.models import LayerGroupInfo, ModelInfo, ModelRegistration, PoolGroupInfo

#: Two full-attention layers of 2 heads x 4 fp16 (64 bytes a token), 4 tokens a block: one
#: pool of 256-byte slots. 33 slots, one the null page: 4 requests of 32 tokens (8 blocks).
MODEL_A: dict[str, Any] = {
    "layers": [layer(0), layer(1)],
    "tokens_per_block": 4,
    "max_seq_len": 32,
    "max_requests": 4,
    "num_blocks": 33,
}
#: A tiny Llama: 2 layers, 4 heads, 2 KV heads, hidden 64 (head_dim 16), bf16, 128 positions.
LLAMA = {
    "model_type": "llama",
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "hidden_size": 64,
    "max_position_embeddings": 128,
}
#: The tiny Llama in 64 KiB: slots of 2 layers x K+V x 2 heads x 16 x 2 bytes x 4 tokens =
#: 1 KiB, 64 of them, 63 besides the null page; a 128-token request takes 32.
MODEL_B: dict[str, Any] = {
    "hf_config": LLAMA,
    "tokens_per_block": 4,
    "max_requests": 4,
    "memory_bytes": 64 << 10,
}
HEADER = "x-kvcm-generation"
SHM = Path("/dev/shm")


def _no_model(resp: httpx.Response) -> bool:
    return resp.status_code == 503 and resp.json()["code"] == "no_model"


@pytest.mark.slow
def test_a_served_process_without_a_model_waits_for_a_registration() -> None:
    with (
        serve_process("--log-level", "warning", model=False) as (url, _, _),
        httpx.Client(base_url=url) as http,
        KVCacheClient(url) as kv,
        KVCacheClient(url) as other,
    ):
        ready = http.get("/readyz")
        assert ready.status_code == 503
        assert ready.json() == {
            "status": "no_model",
            "detail": "no model: register one with POST /v1/model",
        }
        assert http.get("/livez").status_code == 200
        assert "kvcm_model_registered 0.0" in http.get("/metrics").text
        assert _no_model(http.get("/v1/layout"))
        assert _no_model(http.post("/v1/allocate", json={"request_id": "a", "num_tokens": 1}))
        with pytest.raises(NoModel) as exc:
            kv.allocate("a", 1)
        assert (exc.value.code, exc.value.status) == ("no_model", 503)
        with pytest.raises(NoModel):
            kv.model()
        idle = http.get("/livez").headers[HEADER]

        # Layers: the exact layout, the config with every default resolved.
        info = kv.register_model(**MODEL_A)
        assert info.generation != idle and kv.generation == info.generation
        assert info.layout.layer_groups == (
            LayerGroupInfo(
                group_id=0,
                pool_group=0,
                layer_ids=(0, 1),
                sliding_window=None,
                sink_blocks=0,
                owner="target",
                reuse="reusable",
                bytes_per_token=64,
            ),
        )
        assert info.layout.pool_groups == (
            PoolGroupInfo(
                pool_group_id=0, layer_groups=(0,), pools=(0,), num_slots=33, slot_bytes=256
            ),
        )
        assert info.layout.null_page and info.layout.max_blocks_per_request == 8
        assert (info.config.device, info.config.share, info.config.memory_bytes) == (
            "cpu",
            True,
            None,
        )
        assert (info.estimate.seq_len, info.estimate.max_requests) == (32, 4)
        assert http.get("/readyz").json() == {"status": "ok", "detail": ""}
        assert http.get("/livez").headers[HEADER] == info.generation
        assert kv.model() == info
        assert kv.allocate("a", 5).num_tokens == 5
        assert kv.block_table("a") == [[1, 2]]
        assert kv.num_free_blocks() == 30
        metrics = http.get("/metrics").text
        assert "kvcm_model_registered 1.0" in metrics
        assert 'kvcm_blocks_total{pool_group="0"} 32.0' in metrics
        assert 'kvcm_ops_total{op="allocate",result="ok"} 1.0' in metrics
        attached = kv.attach()  # the pools of model A
        attached.check()

        # Refused while a request lives: nothing changes.
        with pytest.raises(RequestsLive) as live:
            kv.register_model(**MODEL_B)
        assert (live.value.status, live.value.detail) == (409, {"num_requests": 1})
        assert kv.generation == info.generation == kv.model().generation
        assert kv.request("a").num_tokens == 5 and kv.block_table("a") == [[1, 2]]
        assert other.request_ids() == ["a"]  # pins model A's generation
        kv.free("a")

        # An HF config: the layers model_config computes, its max_position_embeddings.
        info_b = kv.register_model(**MODEL_B)
        assert info_b.generation not in (info.generation, idle)
        assert kv.generation == info_b.generation
        assert info_b.config.layers == [
            LayerSpec.model_validate(spec) for spec in layers_from_hf_config(LLAMA)
        ]
        assert [(s.num_kv_heads, s.head_dim, s.dtype) for s in info_b.config.layers] == [
            (2, 16, "bf16"),
            (2, 16, "bf16"),
        ]
        assert (info_b.config.max_seq_len, info_b.layout.pool_groups[0].num_slots) == (128, 64)
        assert (info_b.estimate.seq_len, info_b.estimate.max_requests) == (128, 1)
        assert kv.num_free_blocks() == kv.num_total_blocks() == 63
        assert kv.consumers() == []  # the consumers of model A's pools are forgotten

        # The other client pinned model A: refused until it reconnects.
        with pytest.raises(StaleGeneration) as stale:
            other.request_ids()
        assert stale.value.status == 409
        other.reconnect()
        assert other.request_ids() == [] and other.generation == info_b.generation
        with pytest.raises(StaleGeneration):
            attached.check()  # the registering client's own pin moved on, the mapping did not
        attached.close()

        # Shared memory: attach to the new pools, which the tables and views describe.
        with kv.attach() as att:
            assert att.generation == info_b.generation
            assert att.layer_view(1, "value").shape == (64, 4, 2, 16)
            assert att.page_tables.shape == (1, 4, 32)
            kv.allocate("b", 9)
            assert att.page_table(0)[0, :4].tolist() == [1, 2, 3, 0]  # 0: the null page
            assert [c.pid for c in kv.consumers()] == [os.getpid()]
            kv.free("b")


def test_a_refused_registration_changes_nothing() -> None:
    app = create_app(KVCacheManager({**MODEL_A, "null_page": True, "share": True}))
    with serve_in_thread(app) as url, KVCacheClient(url) as kv, httpx.Client(base_url=url) as http:
        before = kv.model()
        refusals: list[tuple[dict[str, Any], type[Exception], str]] = [
            ({**MODEL_A, "hf_config": LLAMA}, InvalidArgument, "one_model_source"),
            ({"num_blocks": 8}, InvalidArgument, "one_model_source"),
            ({**MODEL_A, "memory_bytes": 1 << 20}, InvalidArgument, "blocks_or_memory"),
            ({**MODEL_A, "tensor_parallel": 2}, InvalidArgument, "tensor_parallel_with_layers"),
            (
                {**MODEL_A, "layers": [layer(0, dtype="nvfp4", head_dim=3)]},
                InvalidArgument,
                "nvfp4_head_dim",
            ),
            ({**MODEL_A, "layers": [layer(0), layer(0)]}, InvalidArgument, "duplicate_layer_id"),
            ({**MODEL_A, "max_lookahead": 32}, InvalidArgument, "lookahead_too_long"),
        ]
        for body, error, kind in refusals:
            with pytest.raises(error) as exc:
                kv.register_model(**body)
            assert exc.value.status == 422, body
            assert exc.value.detail["errors"][0]["type"] == kind, exc.value.detail
        # The budget cannot hold one 128-token request: 32 KiB are 32 slots of 1 KiB.
        with pytest.raises(InsufficientMemory) as exc:
            kv.register_model(**{**MODEL_B, "memory_bytes": 32 << 10})
        assert exc.value.status == 422 and exc.value.detail["max_seq_len_that_fits"] == 124
        # More slots than this machine has memory for.
        with pytest.raises(InsufficientMemory) as exc:
            kv.register_model(**{**MODEL_A, "num_blocks": 2**31 - 1, "max_requests": 10**6})
        assert exc.value.detail["needed_bytes"] > exc.value.detail["free_bytes"]
        with pytest.raises(UnsupportedModel) as unsupported:
            kv.register_model(hf_config=LLAMA | {"layer_types": ["full_attention", "linear"]})
        assert (unsupported.value.code, unsupported.value.status) == ("unsupported_model", 422)
        with pytest.raises(InvalidArgument):
            kv.register_model(hf_config={"num_hidden_layers": 10**9, "num_attention_heads": 1})
        malformed = http.post(
            "/v1/model", content=b"{", headers={"content-type": "application/json"}
        )
        assert (malformed.status_code, malformed.json()["code"]) == (400, "malformed_request")
        assert kv.model() == before and kv.generation == before.generation
        assert http.get("/readyz").status_code == 200


def test_serve_without_a_model_checks_its_device_at_start(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["serve", "--device", "cuda:99", "--port", "0"]) == 2
    assert "kvcm: device_unavailable: device 'cuda:99' asked for" in capsys.readouterr().err


@pytest.mark.slow
def test_wait_for_model_returns_once_another_client_registers_and_times_out_typed() -> None:
    args = ("--num-blocks", "33", "--log-level", "warning")
    with serve_process(*args, model=False) as (url, _, _), KVCacheClient(url) as kv:
        start = time.monotonic()
        with pytest.raises(ModelWaitTimeout) as exc:
            kv.wait_for_model(timeout_s=0.3)
        assert 0.3 <= time.monotonic() - start < 3
        assert isinstance(exc.value, NoModel) and exc.value.code == "model_wait_timeout"
        assert exc.value.detail == {"timeout_s": 0.3, "last_code": "no_model"}
        assert kv.generation is None  # refusals pin nothing

        registered: list[ModelInfo] = []

        def register() -> None:
            time.sleep(0.3)
            with KVCacheClient(url) as scheduler:
                registered.append(scheduler.register_model(layers=MODEL_A["layers"]))

        thread = threading.Thread(target=register)
        thread.start()
        layout = kv.wait_for_model(timeout_s=30)
        thread.join()
        (info,) = registered
        assert layout == info.layout and kv.generation == info.generation
        # The service's flags are the defaults: its 33 slots, serve's 4096 tokens.
        assert (info.config.num_blocks, info.config.max_seq_len) == (33, 4096)
        assert kv.wait_for_model(timeout_s=1) == layout  # at once, now


def test_the_body_limit_follows_the_registered_max_seq_len() -> None:
    app = create_app(None)
    # 190000 ids of 5 digits: over 1.1 MB, past the 1 MiB limit of a 4096-token model (the
    # limit of a 200000-token one is 1.66 MB).
    body = {"token_ids": [12345] * 190_000}
    tiny = [{"layer_id": 0, "num_kv_heads": 1, "head_dim": 1, "dtype": "fp8_e4m3"}]
    with serve_in_thread(app) as url, KVCacheClient(url) as kv, httpx.Client(base_url=url) as http:
        kv.register_model(layers=tiny, num_blocks=64)
        assert http.post("/v1/probe", json=body).json()["code"] == "payload_too_large"
        kv.register_model(layers=tiny, max_seq_len=200_000, num_blocks=64)
        assert http.post("/v1/probe", json=body).json() == {"num_hit_tokens": 0}


def test_a_registration_answers_open_event_long_polls() -> None:
    app = create_app(KVCacheManager({**MODEL_A, "share": True}))
    with serve_in_thread(app) as url, KVCacheClient(url) as kv, KVCacheClient(url) as router:
        router.events()
        answers: list[BaseException] = []

        def poll() -> None:
            try:
                router.events(timeout_s=30)
            except StaleGeneration as exc:
                answers.append(exc)

        thread = threading.Thread(target=poll)
        thread.start()
        time.sleep(0.3)  # the poll waits in the service
        start = time.monotonic()
        kv.register_model(**MODEL_B)
        thread.join(10)
        assert time.monotonic() - start < 5 and len(answers) == 1


def test_the_async_client_registers_waits_and_is_told_of_stale_generations() -> None:
    async def scenario(url: str) -> None:
        async with AsyncKVCacheClient(url) as kv, AsyncKVCacheClient(url) as other:
            with pytest.raises(ModelWaitTimeout):
                await kv.wait_for_model(timeout_s=0.1)
            with pytest.raises(NoModel):
                await kv.model()
            info = await kv.register_model(**MODEL_A)
            assert kv.generation == info.generation
            assert await other.wait_for_model(timeout_s=5) == info.layout
            await kv.allocate("a", 5)
            with pytest.raises(RequestsLive):
                await kv.register_model(**MODEL_B)
            await kv.free("a")
            info_b = await kv.register_model(**MODEL_B)
            assert (await kv.model()).generation == info_b.generation != info.generation
            with pytest.raises(StaleGeneration):
                await other.stats()
            other.reconnect()
            assert (await other.stats()).total_blocks == {0: 63}
            # The same model again is a rebuild: a new generation, the same config.
            again = await kv.register_model(**MODEL_B)
            assert again.config == info_b.config and again.generation != info_b.generation

    with serve_in_thread(create_app(None)) as url:
        asyncio.run(scenario(url))


def test_the_manager_registers_in_place() -> None:
    m = KVCacheManager({**MODEL_A, "share": True})
    old = m.generation
    m.allocate("a", 5)
    with pytest.raises(RequestsLive):
        m.register_model(**MODEL_B)
    assert m.generation == old and m.block_table("a") == [[0, 1]]  # no null page here
    with pytest.raises(InvalidArgument):
        m.register_model(layers=[layer(0)], hf_config=LLAMA)
    with pytest.raises(InvalidArgument):
        m.register_model(m.config, layers=[layer(0)])
    assert m.generation == old and m.request_ids() == ["a"]
    m.free("a")

    info = m.register_model(**MODEL_B)
    assert m.generation == info.generation != old
    assert m.model() == info
    # The manager's device and share, the registration's budget and the serve defaults.
    assert (info.config.device, info.config.share, info.config.null_page) == ("cpu", True, True)
    assert m.num_free_blocks() == m.num_total_blocks() == 63
    assert m.allocate("b", 128).num_tokens == 128 and m.num_free_blocks() == 31
    assert m.pools().generation == info.generation
    with pytest.raises(RequestsLive):
        m.register_model(**MODEL_A)
    m.free("b")

    # A ManagerConfig is taken as it is; the same one again still rebuilds.
    again = m.register_model(info.config)
    assert again.config == info.config and again.generation != info.generation
    cfg = {**MODEL_A, "num_blocks": 9}
    assert m.register_model(cfg).config.num_blocks == 9
    assert m.num_total_blocks() == 9  # no null page: the config does not ask for it
    # Without a budget the manager's own is kept.
    assert m.register_model(layers=[layer(0)]).config.num_blocks == 9


@pytest.mark.skipif(not SHM.is_dir(), reason="POSIX shared memory lives in /dev/shm")
def test_a_registration_unlinks_the_old_segments() -> None:
    m = KVCacheManager({**MODEL_A, "share": True})
    old = m.pools()
    names = [s.name for s in (*old.pools, old.page_tables)]
    assert all((SHM / str(n)).exists() for n in names)
    m.register_model(**MODEL_B)
    assert not any((SHM / str(n)).exists() for n in names)
    m.close()


def test_registering_means_what_starting_with_the_model_means(tmp_path: Path) -> None:
    """``kvcm serve --layers`` and a registration of the same layers under the same flags give
    one config; a ``--config`` file lends its device, share and budget to registrations."""
    sizing: dict[str, Any] = {"num_blocks": 33, "tokens_per_block": 4, "max_seq_len": 32}
    layers = tmp_path / "layers.json"
    layers.write_text(json.dumps(MODEL_A["layers"]))
    started = Settings(layers=layers, max_requests=4, **sizing).manager_config()
    flags = Settings(max_requests=4, **sizing).registration_defaults()
    assert started == to_config(ModelRegistration(layers=MODEL_A["layers"]), flags)

    path = tmp_path / "config.json"
    path.write_text(json.dumps({**MODEL_A, "share": False}))
    settings = Settings(config=path, max_requests=2)
    defaults = settings.registration_defaults(settings.manager_config())
    cfg = to_config(ModelRegistration(hf_config=LLAMA), defaults)
    assert (cfg.device, cfg.share, cfg.num_blocks, cfg.memory_bytes) == ("cpu", False, 33, None)
    assert (cfg.max_requests, cfg.max_seq_len, cfg.tokens_per_block) == (2, 128, 16)

    # The registration's layer options win over the service's --kv-dtype and --tensor-parallel.
    service = {"kv_dtype": "fp16", "tensor_parallel": 2, "num_blocks": 8}
    own = ModelRegistration(hf_config=LLAMA, kv_dtype="fp8_e4m3", tensor_parallel=1)
    assert {(s.dtype, s.num_kv_heads) for s in to_config(own, service).layers} == {("fp8_e4m3", 2)}
    plain = ModelRegistration(hf_config=LLAMA)
    assert {(s.dtype, s.num_kv_heads) for s in to_config(plain, service).layers} == {("fp16", 1)}
