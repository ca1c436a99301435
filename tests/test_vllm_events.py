"""KV events in vLLM's format on ZeroMQ (``kvcm serve --kv-events-zmq``): a real SUB socket on
a real service, decoded with a decoder written from vLLM's schema (vllm/distributed/
kv_events.py: three frames, topic, 8-byte big-endian batch seq, msgpack ``KVEventBatch``)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import msgpack
import pytest
from helpers import layer, manager

from kvcm import block_keys

zmq = pytest.importorskip("zmq")

TPB = 4


@dataclass
class VllmIndex:
    """What a router built for vLLM keeps: block hashes per medium, from its event schema."""

    seqs: list[int] = field(default_factory=list)
    blocks: dict[str, set[bytes]] = field(default_factory=dict)
    stored: list[dict[str, Any]] = field(default_factory=list)

    def take(self, frames: list[bytes]) -> None:
        topic, seq, payload = frames
        assert topic == b"" and len(seq) == 8
        self.seqs.append(int.from_bytes(seq, "big"))
        batch = msgpack.unpackb(payload, raw=False)
        assert set(batch) == {"ts", "events"} and isinstance(batch["ts"], float)
        for event in batch["events"]:
            kind = event["type"]
            if kind == "AllBlocksCleared":
                assert set(event) == {"type"}
                self.blocks.clear()
            elif kind == "BlockStored":
                assert set(event) == {
                    "type", "block_hashes", "parent_block_hash", "token_ids", "block_size",
                    "lora_id", "medium", "lora_name", "group_idx",
                }  # fmt: skip
                self.stored.append(event)
                self.blocks.setdefault(event["medium"], set()).update(event["block_hashes"])
            else:
                assert kind == "BlockRemoved"
                assert set(event) == {"type", "block_hashes", "medium", "group_idx"}
                self.blocks.get(event["medium"], set()).difference_update(event["block_hashes"])


def _receive(sub: Any, index: VllmIndex, batches: int) -> None:
    for _ in range(batches):
        assert sub.poll(5000), "no batch came"
        index.take(sub.recv_multipart())


def test_a_vllm_router_follows_kvcm_over_zeromq() -> None:
    from servers import serve_in_thread

    from kvcm.server.app import create_app
    from kvcm_client import KVCacheClient

    m = manager([layer(0)], num_blocks=8, host_memory_bytes=1 << 12)
    app = create_app(m, kv_events_zmq="tcp://127.0.0.1:0")
    endpoint = app.state.kvcm.event_publisher.endpoint  # the port it bound
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    index = VllmIndex()
    try:
        with serve_in_thread(app) as url, KVCacheClient(url) as kv:
            # ZeroMQ's slow joiner: a PUB drops what it sends before a subscription arrives.
            time.sleep(0.5)
            prompt = list(range(13))
            kv.allocate("a", 13, token_ids=prompt)
            kv.commit("a", prompt)  # 3 full blocks: one BlockStored
            _receive(sub, index, 1)
            keys = block_keys(prompt, TPB)
            stored = index.stored[-1]
            assert stored["block_hashes"] == keys[:3] and stored["parent_block_hash"] is None
            assert stored["token_ids"] == prompt[:12] and stored["block_size"] == TPB
            assert stored["medium"] == "GPU" and stored["group_idx"] == 0
            kv.free("a")
            kv.allocate("x", 32)  # every slot: the three blocks move to the host
            _receive(sub, index, 1)
            assert index.blocks["GPU"] == set() and index.blocks["CPU"] == set(keys[:3])
            # A new model (a new generation): vLLM's format has no epoch, so a router is
            # told to clear first.
            kv.free("x")
            kv.register_model(
                layers=[layer(0)],
                num_blocks=8,
                max_seq_len=64,
                max_requests=4,
                tokens_per_block=TPB,
            )
            kv.allocate("b", 9, token_ids=prompt[:9])
            kv.commit("b", prompt[:9])
            _receive(sub, index, 2)
            assert index.blocks == {"GPU": set(keys[:2])}
            assert index.seqs == list(range(len(index.seqs)))  # batches counted from 0
    finally:
        sub.close(linger=0)
        app.state.kvcm.event_publisher.close()
