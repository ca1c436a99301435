"""Disaggregated prefill and decode through two real ``kvcm serve --transfer nixl`` processes:
the scheduler's calls over HTTP, the KV written and read by this test through each
sidecar's shared pools (as the engines would), NIXL moving it between the two processes."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("nixl_cu12", reason="the transfer extra (nixl-cu12) is not installed")

from servers import free_port, serve_process

from kvcm_client import KVCacheClient
from kvcm_client.errors import (
    KVInFlight,
    PeerUnreachable,
    ScopeMismatch,
    Unauthorized,
    UnknownPeer,
    UnknownRequest,
)

LAYERS = [
    {"layer_id": 0, "num_kv_heads": 2, "head_dim": 8, "dtype": "fp16"},
    {"layer_id": 1, "num_kv_heads": 2, "head_dim": 8, "dtype": "fp16", "sliding_window": 8},
]
FLAGS = [
    "--num-blocks",
    "64",
    "--tokens-per-block",
    "4",
    "--max-seq-len",
    "128",
    "--max-requests",
    "8",
    "--transfer",
    "nixl",
]


@pytest.fixture(scope="module")
def sidecars(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    layers = tmp_path_factory.mktemp("transfer") / "layers.json"
    layers.write_text(json.dumps(LAYERS))
    with (
        serve_process(
            "--layers",
            str(layers),
            *FLAGS,
            "--transfer-name",
            "prefill",
            env={"KVCM_API_TOKEN": "tok-prefill"},
        ) as (prefill_url, _, _),
        serve_process(
            "--layers",
            str(layers),
            *FLAGS,
            "--transfer-name",
            "decode",
            "--peer",
            f"prefill={prefill_url}",
            "--peer",
            "gone=http://127.0.0.1:9",
            env={
                "KVCM_API_TOKEN": "tok-decode",
                "KVCM_PEER_TOKEN_PREFILL": "tok-prefill",
                "KVCM_PEER_TOKEN": "tok-other",
            },
        ) as (decode_url, _, _),
    ):
        yield prefill_url, decode_url


def write_kv(kv: KVCacheClient, att: Any, rid: str, seed: int) -> None:
    """Random KV in every (layer, role) page the request holds, through the shared pools."""
    gen = torch.Generator().manual_seed(seed)
    for g, slots in enumerate(kv.block_table(rid)):
        for (layer, _role), view in att.views.items():
            if kv_group(layer) != g:
                continue
            for s in slots:
                if s >= 0:
                    view[s] = torch.randn(view[s].shape, generator=gen).to(view.dtype)


def kv_group(layer: int) -> int:
    return 0 if layer == 0 else 1


def read_kv(kv: KVCacheClient, att: Any, rid: str) -> dict[tuple[int, int, int, str], Any]:
    """Every held page of the request, by (group, position, layer, role)."""
    out = {}
    for g, slots in enumerate(kv.block_table(rid)):
        for (layer, role), view in att.views.items():
            if kv_group(layer) == g:
                for pos, s in enumerate(slots):
                    if s >= 0:
                        out[(g, pos, layer, role)] = view[s].clone()
    return out


def wait(kv: KVCacheClient, rid: str) -> Any:
    for _ in range(5000):
        state = kv.transfer_status([rid])[0]
        if state.state != "pulling":
            return state
        time.sleep(0.002)
    raise TimeoutError(rid)


def test_prefill_to_decode_over_http(sidecars: tuple[str, str]) -> None:
    prefill_url, decode_url = sidecars
    with (
        KVCacheClient(prefill_url, token="tok-prefill") as p,
        KVCacheClient(decode_url, token="tok-decode") as d,
        p.attach() as p_att,
        d.attach() as d_att,
    ):
        free_p, free_d = p.num_free_blocks(), d.num_free_blocks()
        tokens = list(range(500, 526))
        # A chunked prefill on the prefill sidecar, KV written chunk by chunk.
        p.allocate("req", 12, tokens[:12])
        write_kv(p, p_att, "req", 1)
        p.commit("req", tokens[:12])
        p.extend("req", 14)
        write_kv(p, p_att, "req", 2)
        p.commit("req", tokens[12:])
        source = read_kv(p, p_att, "req")
        export = p.hand_off("req", deadline_s=30)
        assert export.token_ids == tokens and export.agent.startswith("prefill-")
        with pytest.raises(KVInFlight):
            p.extend("req", 1)

        state = d.pull("dec", "prefill", "req", lookahead=2)
        assert state.state in ("pulling", "ready")
        # A step's answer lists it once it ended (the service's loop polls meanwhile).
        ended = []
        for _ in range(2000):
            ended += d.step_columns().pulls or []
            if ended:
                break
            time.sleep(0.002)
        assert [(p.request_id, p.state) for p in ended] == [("dec", "ready")]
        assert ended[0].handle == d.request("dec").handle
        assert wait(d, "dec").state == "ready"
        info = d.request("dec")
        assert (info.num_tokens, info.num_committed, info.capacity) == (26, 26, 28)
        mine = read_kv(d, d_att, "dec")
        # Every page the peer still held arrived; the window's released ones are released here.
        assert set(mine) == set(source)
        for key, page in source.items():
            assert torch.equal(mine[key], page), key
        d.extend("dec", 1)
        d.free("dec")
        # The prefill sidecar freed its request on the puller's message (blocks cached).
        for _ in range(500):
            if p.num_free_blocks() == free_p:
                break
            time.sleep(0.01)
        assert p.num_free_blocks() == free_p and p.request_ids() == []
        assert d.num_free_blocks() == free_d


def test_isolation_and_refusals(sidecars: tuple[str, str]) -> None:
    prefill_url, decode_url = sidecars
    with (
        KVCacheClient(prefill_url, token="tok-prefill") as p,
        KVCacheClient(decode_url, token="tok-decode") as d,
        KVCacheClient(prefill_url) as anonymous,
    ):
        tokens = list(range(700, 710))
        p.allocate("salted", 10, tokens, cache_salt="tenant-a")
        p.commit("salted", tokens)
        p.hand_off("salted", deadline_s=30)
        free_d = d.num_free_blocks()
        with pytest.raises(ScopeMismatch):  # no salt, or another: never served
            d.pull("x", "prefill", "salted")
        with pytest.raises(ScopeMismatch):
            d.pull("x", "prefill", "salted", cache_salt="tenant-b")
        with pytest.raises(UnknownPeer):  # only configured peers
            d.pull("x", "elsewhere", "salted", cache_salt="tenant-a")
        with pytest.raises(PeerUnreachable):
            d.pull("x", "gone", "salted", cache_salt="tenant-a")
        with pytest.raises(UnknownRequest):
            d.pull("x", "prefill", "never-handed-off", cache_salt="tenant-a")
        with pytest.raises(Unauthorized):  # the agent metadata needs the token
            anonymous.transfer_agent()
        assert d.num_free_blocks() == free_d and d.request_ids() == []
        assert d.pull("x", "prefill", "salted", cache_salt="tenant-a").state in ("pulling", "ready")
        assert wait(d, "x").state == "ready"
        assert d.committed_tokens("x") == tokens
        d.free("x")


def test_transfer_needs_a_token(tmp_path: Path) -> None:
    layers = tmp_path / "layers.json"
    layers.write_text(json.dumps(LAYERS))
    with pytest.raises(RuntimeError) as err, serve_process("--layers", str(layers), *FLAGS):
        pass
    assert "KVCM_API_TOKEN" in str(err.value)


def test_fetch_a_prefix_from_a_peer_over_http(sidecars: tuple[str, str]) -> None:
    prefill_url, decode_url = sidecars
    with (
        KVCacheClient(prefill_url, token="tok-prefill") as p,
        KVCacheClient(decode_url, token="tok-decode") as d,
        p.attach() as p_att,
        d.attach() as d_att,
    ):
        prompt = list(range(900, 930))
        p.allocate("cached", 21, prompt[:21])
        write_kv(p, p_att, "cached", 5)
        p.commit("cached", prompt[:21])
        source = {k: v for k, v in read_kv(p, p_att, "cached").items() if k[1] < 5}
        p.free("cached")  # its 5 full blocks stay cached on the prefill sidecar
        free_p = p.num_free_blocks()
        seq = d.events().last_seq
        state = d.fetch("f", "prefill", 30, prompt)
        assert state.state in ("pulling", "ready")
        assert wait(d, "f").state == "ready"
        assert d.request("f").num_committed == 20
        mine = read_kv(d, d_att, "f")
        # Every full-attention page arrived; the window group's released positions are
        # released here too.
        assert {k for k in source if k[0] == 0} <= set(mine)
        for key, page in source.items():
            if key in mine:
                assert torch.equal(mine[key], page), key
        assert any(e.kind == "block_stored" for e in d.events(after=seq).events)
        assert d.probe(prompt) == 20
        d.free("f")
        for _ in range(500):
            if p.num_free_blocks() == free_p and p.request_ids() == []:
                break
            time.sleep(0.01)
        assert p.request_ids() == [] and p.num_free_blocks() == free_p


def test_a_restarted_peer_is_a_new_agent(tmp_path: Path) -> None:
    """The prefill sidecar restarts on its port: its handed-off request died with it
    (``unknown_request``, nothing reserved here), and the next pull loads its new agent."""
    layers = tmp_path / "layers.json"
    layers.write_text(json.dumps(LAYERS))
    port = free_port()
    prefill = ["--layers", str(layers), *FLAGS, "--transfer-name", "prefill"]
    env_p = {"KVCM_API_TOKEN": "tok-prefill"}
    prefill_url = f"http://127.0.0.1:{port}"
    with (
        serve_process(
            "--layers",
            str(layers),
            *FLAGS,
            "--transfer-name",
            "decode",
            "--peer",
            f"prefill={prefill_url}",
            env={"KVCM_API_TOKEN": "tok-decode", "KVCM_PEER_TOKEN": "tok-prefill"},
        ) as (decode_url, _, _),
        KVCacheClient(decode_url, token="tok-decode") as d,
    ):
        free_d = d.num_free_blocks()
        agents = []
        for life in range(2):
            with serve_process(*prefill, env=env_p, port=port) as (url, _, _):
                assert url == prefill_url
                with KVCacheClient(url, token="tok-prefill") as p:
                    agents.append(p.transfer_agent().name)
                    if life == 1:  # "dies", handed off before the restart, died with it
                        with pytest.raises(UnknownRequest):
                            d.pull("old", "prefill", "dies")
                    tokens = list(range(100 * life, 100 * life + 9))
                    p.allocate("r", 9, tokens)
                    p.commit("r", tokens)
                    p.hand_off("r", deadline_s=30)
                    # Each life's first pull loads that life's agent.
                    assert d.pull(f"new{life}", "prefill", "r").state in ("pulling", "ready")
                    assert wait(d, f"new{life}").state == "ready"
                    assert d.committed_tokens(f"new{life}") == tokens
                    d.free(f"new{life}")
                    if life == 0:
                        p.allocate("dies", 4, [1, 2, 3, 4])
                        p.commit("dies", [1, 2, 3, 4])
                        p.hand_off("dies", deadline_s=30)
        assert agents[0] != agents[1]  # a new generation is a new agent
        assert d.num_free_blocks() == free_d and d.request_ids() == []
