"""kvcm's KV events in vLLM's format, on a ZeroMQ PUB socket (``kvcm serve --kv-events-zmq``),
so that routers built for vLLM (its ``ZmqEventPublisher`` consumers) follow kvcm as they
follow a vLLM engine (docs/prefix-reuse.md#vllms-event-format).

vLLM's schema (``vllm/distributed/kv_events.py``): each message is three frames, the topic,
an 8-byte big-endian sequence number counting batches from 0, and a msgpack ``KVEventBatch``:
a map ``{"ts": float, "events": [...]}`` whose events are maps tagged by ``"type"``:

- ``BlockStored``: ``block_hashes`` (kvcm's 32-byte keys, as bytes), ``parent_block_hash``
  (bytes or None), ``token_ids``, ``block_size``, ``lora_id`` (an int LoRA id, else None),
  ``medium`` (``"GPU"`` for the device pools, ``"CPU"`` for the host tier), ``lora_name``
  (a str LoRA id, else None), ``group_idx`` (the layer group);
- ``BlockRemoved``: ``block_hashes``, ``medium``, ``group_idx``;
- ``AllBlocksCleared``.

Differences kvcm keeps: a salted tenant's blocks carry empty ``token_ids`` (its prompts never
leave in events), host-tier events carry keys only (empty ``token_ids`` too), and a new
manager generation (a restart of the service keeps nothing; a registration) first sends an
``AllBlocksCleared``, since vLLM's format has no epoch.
"""

from __future__ import annotations

import time
from typing import Any

import msgpack

from kvcm_client.errors import KVEventsDisabled
from kvcm_client.models import KVEvent

_MEDIUM = {"device": "GPU", "host": "CPU"}


def vllm_event(event: KVEvent, block_size: int) -> dict[str, Any]:
    """One kvcm event as vLLM's tagged map."""
    if event.kind == "all_blocks_cleared":
        return {"type": "AllBlocksCleared"}
    hashes = [bytes.fromhex(k) for k in event.block_keys]
    medium = _MEDIUM[event.tier]
    if event.kind == "block_removed":
        return {
            "type": "BlockRemoved",
            "block_hashes": hashes,
            "medium": medium,
            "group_idx": event.layer_group,
        }
    lora = event.lora_id
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": None if event.parent_key is None else bytes.fromhex(event.parent_key),
        "token_ids": event.token_ids or [],
        "block_size": block_size,
        "lora_id": lora if isinstance(lora, int) else None,
        "medium": medium,
        "lora_name": lora if isinstance(lora, str) else None,
        "group_idx": event.layer_group,
    }


def vllm_batch(events: list[dict[str, Any]], ts: float | None = None) -> bytes:
    """A msgpack ``KVEventBatch`` of vLLM event maps."""
    return msgpack.packb({"ts": time.time() if ts is None else ts, "events": events})


class VllmEventPublisher:
    """Publishes a manager's new events in vLLM's format after each op that logged some."""

    def __init__(self, endpoint: str, topic: str = "") -> None:
        import zmq

        self._socket = zmq.Context.instance().socket(zmq.PUB)
        self._socket.bind(endpoint)
        self.endpoint = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._topic = topic.encode()
        self._seq = 0
        self._generation: str | None = None
        self._after = 0

    def publish(self, manager: Any) -> None:
        """Send the events ``manager`` logged since the last call (one batch), after an
        ``AllBlocksCleared`` batch if it is another generation than the last call's."""
        if manager.generation != self._generation:
            if self._generation is not None:
                self._send(vllm_batch([{"type": "AllBlocksCleared"}]))
            self._generation, self._after = manager.generation, 0
        while True:
            try:
                batch = manager.events(self._after, 1000)
            except KVEventsDisabled:  # a model registered with kv_events off
                return
            if batch.lost:  # one op logged more than the buffer: start over, cleared
                self._send(vllm_batch([{"type": "AllBlocksCleared"}]))
            if not batch.events:
                return
            block_size = manager.tokens_per_block
            self._send(vllm_batch([vllm_event(e, block_size) for e in batch.events]))
            self._after = batch.events[-1].seq

    def _send(self, payload: bytes) -> None:
        self._socket.send_multipart((self._topic, self._seq.to_bytes(8, "big"), payload))
        self._seq += 1

    def close(self) -> None:
        self._socket.close(linger=0)
