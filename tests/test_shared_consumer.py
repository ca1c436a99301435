"""The inference server's side, end to end: the manager in a ``kvcm serve`` process, this
process as the consumer that maps its pools and page tables and computes attention through
them, checked against dense attention over the same keys and values at every step."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch
from servers import serve_process

from kvcm_client import KVCacheClient
from kvcm_client.errors import StaleGeneration
from kvcm_client.paged_attention import attention, key_mask, write_kv
from kvcm_client.shared import Attachment

pytestmark = pytest.mark.slow  # a real service and consumer processes mapping its pools

TPB = 4
LAYERS = [
    {"layer_id": 0, "num_kv_heads": 2, "head_dim": 8, "dtype": "fp32"},  # full, GQA 2:1
    {
        "layer_id": 1,
        "num_kv_heads": 2,
        "head_dim": 8,
        "dtype": "fp32",
        "sliding_window": 10,
        "sink_tokens": 4,
    },
    {"layer_id": 2, "num_kv_heads": 1, "head_dim": 16, "kv_factor": 1, "dtype": "fp32"},
    {"layer_id": 3, "num_kv_heads": 2, "head_dim": 8, "dtype": "fp32", "sliding_window": 6},
]
Q_HEADS = {0: 4, 1: 4, 2: 2, 3: 2}


def write_config(tmp_path: Path, device: str = "cpu") -> Path:
    cfg = {
        "layers": LAYERS,
        "tokens_per_block": TPB,
        "max_requests": 4,
        "max_seq_len": 160,
        "num_blocks": 200,
        "device": device,
        "share": True,
    }
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(cfg))
    return path


@pytest.fixture
def service(tmp_path: Path) -> object:
    with serve_process("--config", str(write_config(tmp_path))) as (url, proc, _):
        yield url, proc


def dense(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, spec: dict) -> torch.Tensor:
    """SDPA over all keys so far; ``q`` are the last positions ``[n, Hq, D]``."""
    n, t = q.shape[0], keys.shape[0]
    mask = key_mask(
        t,
        n,
        torch.ones(t, dtype=torch.bool),
        spec.get("sliding_window"),
        spec.get("sink_tokens", 0),
    )
    g = q.shape[1] // keys.shape[1]
    k = keys.repeat_interleave(g, dim=1).transpose(0, 1)[None]  # [1, Hq, T, D]
    v = values.repeat_interleave(g, dim=1).transpose(0, 1)[None]
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k, v, attn_mask=mask[None, None]
    )
    return out[0].transpose(0, 1)


def test_prefill_then_100_decode_steps_match_dense_attention(service: tuple[str, object]) -> None:
    assert decode_against_dense(service[0], steps=100) < 1e-5


def decode_against_dense(url: str, steps: int) -> float:
    """Prefill 3 requests, decode ``steps`` tokens; at every step and layer the consumer's
    paged attention must equal dense SDPA. Returns the worst absolute difference."""
    gen = torch.Generator().manual_seed(0)
    prompts = {"a": 9, "b": 17, "c": 5}
    with KVCacheClient(url) as kv, kv.attach() as att:
        assert [c.pid for c in kv.consumers()] == [os.getpid()]
        ids = list(prompts)
        history: dict[tuple[str, int], list[torch.Tensor]] = {}
        for rid, n in prompts.items():
            kv.allocate(rid, n)
        new = dict(prompts)
        worst = 0.0
        for step in range(steps + 1):  # the prefill, then the decode steps
            if step:
                kv.extend_many(ids)
                new = dict.fromkeys(ids, 1)
            mappings = kv.slot_mappings(ids)
            for spec in LAYERS:
                lid = spec["layer_id"]
                group = att.layout.layer_group_of[lid]
                start = 0
                for rid in ids:
                    n = new[rid]
                    info = kv.request(rid)
                    q = torch.randn(n, Q_HEADS[lid], spec["head_dim"], generator=gen)
                    k = torch.randn(n, spec["num_kv_heads"], spec["head_dim"], generator=gen)
                    v = torch.randn(n, spec["num_kv_heads"], spec["head_dim"], generator=gen)
                    slots = torch.tensor(mappings[group][start : start + n])
                    start += n
                    key_only = spec.get("kv_factor", 2) == 1
                    write_kv(att, lid, slots, k, None if key_only else v)
                    keys = history.setdefault((rid, lid), [])
                    keys.append(torch.stack([k, k if key_only else v]))
                    all_kv = torch.cat(keys, dim=1)
                    got = attention(att, lid, info.row, info.num_tokens, q).cpu()
                    want = dense(q, all_kv[0], all_kv[1], spec)
                    worst = max(worst, float((got - want).abs().max()))
                    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (step, rid, lid)
        # Windows really released blocks: row of "b" in layer 1's group starts with sinks.
        row_b = att.page_table(att.layout.layer_group_of[1])[kv.request("b").row]
        assert int(row_b[0]) >= 0 and int(row_b[1]) == -1
        for rid in ids:
            kv.free(rid)
    with KVCacheClient(url) as kv:
        assert kv.consumers() == []  # close() unregistered
    return worst


def test_a_consumer_that_dies_without_detaching_is_forgotten(
    service: tuple[str, object],
) -> None:
    url, _ = service
    code = (
        "import os, sys; from kvcm_client import KVCacheClient; "
        f"a = KVCacheClient({url!r}).attach(); print(os.getpid(), flush=True); "
        "sys.stdin.readline(); os._exit(0)"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert child.stdout is not None and child.stdin is not None
    pid = int(child.stdout.readline())
    with KVCacheClient(url) as kv:
        assert [c.pid for c in kv.consumers()] == [pid]
        assert "kvcm_consumers_attached 1.0" in httpx.get(f"{url}/metrics").text
        child.stdin.write("\n")
        child.stdin.flush()
        child.wait(10)  # exited without close()
        assert kv.consumers() == []


def test_descriptors_of_another_generation_are_refused(service: tuple[str, object]) -> None:
    url, _ = service
    with KVCacheClient(url) as kv:
        layout = kv.pools()
        with pytest.raises(StaleGeneration):
            Attachment(layout, expected_generation="0" * 32)
        resp = httpx.post(f"{url}/v1/consumers", json={"pid": os.getpid(), "generation": "x" * 32})
        assert resp.status_code == 409 and resp.json()["code"] == "stale_generation"
        gone = layout.model_copy(
            update={"page_tables": layout.page_tables.model_copy(update={"name": "kvcm-gone"})}
        )
        with pytest.raises(StaleGeneration):
            Attachment(gone)


def test_views_alias_the_service_memory(service: tuple[str, object]) -> None:
    """A write through one attachment is seen through another: the memory is shared."""
    url, _ = service
    with KVCacheClient(url) as kv, kv.attach() as first, kv.attach() as second:
        first.layer_view(0, "value")[3, 1, 1, 2] = 42.0
        assert float(second.layer_view(0, "value")[3, 1, 1, 2]) == 42.0
        kv.allocate("x", 6)
        row = kv.request("x").row
        assert first.page_table(0)[row, :2].tolist() == kv.block_table("x")[0]


def test_the_async_client_attaches_and_detaches(service: tuple[str, object]) -> None:
    import asyncio

    from kvcm_client import AsyncKVCacheClient

    async def run() -> tuple[list[int], list[int], float]:
        async with AsyncKVCacheClient(service[0]) as kv:
            att = await kv.attach()
            attached = [c.pid for c in await kv.consumers()]
            info = await kv.allocate("z", 5)
            slots = torch.tensor(await kv.slot_mapping(["z"], 0))
            write_kv(att, 0, slots, torch.ones(5, 2, 8), torch.full((5, 2, 8), 2.0))
            out = attention(att, 0, info.row, 5, torch.zeros(1, 4, 8))
            await kv.detach(att)
            return attached, [c.pid for c in await kv.consumers()], float(out.mean())

    attached, after, mean = asyncio.run(run())
    assert attached == [os.getpid()] and after == []
    assert mean == 2.0  # zero queries: uniform weights over values that are all 2


def test_an_attach_whose_mapping_fails_leaves_no_consumer(
    service: tuple[str, object], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The service hears of a consumer before it maps (so that pools are not freed under it);
    a mapping that fails (CUDA pools and no usable CuPy, say) unregisters it again, or the
    service would wait on a consumer that never was."""
    import asyncio

    from kvcm_client import AsyncKVCacheClient, shared
    from kvcm_client.errors import DeviceUnavailable

    def fails(*_: object, **__: object) -> None:
        raise DeviceUnavailable("mapping CUDA pools needs CuPy")

    monkeypatch.setattr(shared, "Attachment", fails)
    with KVCacheClient(service[0]) as kv:
        with pytest.raises(DeviceUnavailable):
            kv.attach()
        assert kv.consumers() == []

    async def run() -> list[object]:
        async with AsyncKVCacheClient(service[0]) as kv:
            with pytest.raises(DeviceUnavailable):
                await kv.attach()
            return list(await kv.consumers())

    assert asyncio.run(run()) == []
