"""Stream-ordered steps end to end (docs/shared-memory.md#stream-ordered-steps).

``kvcm serve --device cuda:0`` shares its pools and tables; this process is the engine: it
attaches with ``stream_order=True`` and runs random decode and chunked-prefill steps with
``step_columns(map_slots=True, stream_ordered=True)`` over the step channel. After each
answer its own stream waits on the service's step event (no host wait on either side),
copies the shared page tables there and records its done event. At the end, every step's
copy and mapping must equal a CPU manager fed the same steps: the tables of that step, not
an earlier one's (the wait) nor a later one's (the done event holds the service's next edits).
The hazard variant delays the engine's stream by a spin kernel before each copy, so that the
service runs several steps ahead of the engine's device work.
"""

from __future__ import annotations

import base64
import json
import random
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from servers import serve_process

from kvcm import KVCacheManager
from kvcm_client import KVCacheClient
from kvcm_client.errors import InvalidArgument

LAYERS = [
    {"layer_id": 0, "num_kv_heads": 2, "head_dim": 8, "dtype": "fp16"},
    {"layer_id": 1, "num_kv_heads": 2, "head_dim": 8, "dtype": "fp16", "sliding_window": 16},
]
CONFIG: dict[str, Any] = {
    "layers": LAYERS,
    "tokens_per_block": 4,
    "max_requests": 12,
    "max_seq_len": 96,
    "num_blocks": 200,
}
EMPTY: dict[str, Any] = {"free": [], "extend": [], "num_new_tokens": [], "allocate": []}
#: The spin before each copy in the hazard test: about 5 ms of the GPU's clock.
SPIN_CYCLES = 10_000_000


def _step(rng: random.Random, live: dict[str, int], serial: list[int]) -> dict[str, Any]:
    """A random step by request id: frees, decode and chunked-prefill extends, allocates.
    ``live``: request id -> its length (updated for the items that will succeed, which the
    caller checks against the reference's statuses)."""
    ids = sorted(live)
    free = [r for r in ids if live[r] > 80 or rng.random() < 0.08]
    for r in free:
        del live[r]
    extend, counts = [], []
    for r in sorted(live):
        n = 1 if rng.random() < 0.7 else rng.randint(2, 12)  # decode, or a prefill chunk
        n = min(n, CONFIG["max_seq_len"] - live[r])
        if n:
            extend.append(r)
            counts.append(n)
            live[r] += n
    allocate = []
    for _ in range(rng.randint(0, 2)):
        if len(live) < CONFIG["max_requests"]:
            rid = f"r{serial[0]}"
            serial[0] += 1
            live[rid] = rng.randint(1, 40)
            allocate.append({"request_id": rid, "num_tokens": live[rid]})
    return {"free": free, "extend": extend, "num_new_tokens": counts, "allocate": allocate}


def _run(
    tmp_path: Path,
    steps: int,
    spin: int,
    seed: int,
    null_page: bool,
    mixed: bool = False,
    spin_after: int = 0,
    decode: bool = False,
    native: bool = True,
) -> None:
    """``spin``: the engine's stream spins that many cycles before it reads the tables,
    ``spin_after`` after it read them and before its done event (the forward's other work).
    ``mixed``: every third step frees one request without ``stream_ordered`` (its edits go
    through the slot mapping's fused launch and its mapping is empty: no device wait in the
    answer either), so a stream-ordered step without edits of its own may follow one whose
    edits only the fused launch's record covers. ``decode``: every other step is a pure
    decode step (extends alone, one token each: the client's decode frame, which the
    service runs through ``decode_step``). ``native`` False: the service without its C core
    (``KVCM_NATIVE=0``): ``DeviceTables.publish`` launches the edits through ``StepLaunch``
    and records the step event itself, and a decode frame's ``decode_step`` runs as
    ``step_columns``."""
    pytest.importorskip("cupy")
    cfg = CONFIG | {"null_page": null_page}
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(cfg | {"device": "cuda:0", "share": True}))
    ref = KVCacheManager(cfg)
    sock = tmp_path / "step.sock"
    rng = random.Random(seed)
    live: dict[str, int] = {}
    serial = [0]
    handles: dict[str, tuple[int, int]] = {}  # request id -> (service's, reference's)
    with (
        serve_process(
            "--config",
            str(path),
            "--step-socket",
            str(sock),
            env=None if native else {"KVCM_NATIVE": "0"},
        ) as (url, _, lines),
        KVCacheClient(url, step_socket=sock) as kv,
        kv.attach(stream_order=True) as att,
    ):
        for _ in range(100):  # the line after "serving on", which a thread drains
            said = [line for line in lines if "step path in" in line]
            if said:
                break
            time.sleep(0.05)
        assert said and ("step path in numpy" in said[0]) == (not native), lines
        stream = torch.cuda.Stream(device=att.page_tables.device)
        copies: list[torch.Tensor] = []
        expected: list[np.ndarray] = []
        for i in range(steps):
            # Every fifth step is empty: it edits nothing, so the service records nothing
            # and the engine's wait refers to the last step that did.
            ordered = not (mixed and i % 3 == 1)
            if not ordered:
                free = sorted(live)[:1]
                for r in free:
                    del live[r]
                step = EMPTY | {"free": free}
            elif decode and i % 2 and len(live) > 1:
                ext = sorted(live)
                for r in ext:
                    live[r] += 1
                step = EMPTY | {"extend": ext, "num_new_tokens": [1] * len(ext)}
            else:
                step = _step(rng, live, serial) if i % 5 != 4 else EMPTY
            free = step["free"]
            ext = step["extend"]
            if step["allocate"] or free or any(n != 1 for n in step["num_new_tokens"]):
                args: dict[str, Any] = {
                    "free": [handles[r][0] for r in free],
                    "allocate": step["allocate"],
                    "num_new_tokens": np.asarray(step["num_new_tokens"], dtype=np.int64),
                }
            else:  # a pure decode step: the client's decode frame, the service's decode_step
                args = {}
            out = kv.step_columns(
                extend=[handles[r][0] for r in ext],
                map_slots=True,
                stream_ordered=ordered,
                **args,
            )
            if "free" in args:
                args["free"] = [handles[r][1] for r in free]
            want = ref.step_columns(extend=[handles[r][1] for r in ext], map_slots=True, **args)
            for section, status in want.status.items():
                assert out.status[section] == status.tolist(), section
            for r in free:
                del handles[r]
            for i, op in enumerate(step["allocate"]):
                if want.status["allocate"][i] == 0:
                    handles[op["request_id"]] = (out.handles[i], int(want.handles[i]))
                else:
                    del live[op["request_id"]]
            for i, r in enumerate(ext):
                if want.status["extend"][i] != 0:  # out of blocks: the length stays
                    live[r] -= step["num_new_tokens"][i]
            # The mapping came from the service's host tables: the reference's values.
            got = np.asarray([list(g) for g in out.slot_mapping], dtype=np.int64)
            assert np.array_equal(got.reshape(want.slot_mapping.shape), want.slot_mapping.numpy())
            # The engine: its stream waits for the step's edits, reads, then says done.
            with torch.cuda.stream(stream):
                att.wait_step()
                if spin:
                    torch.cuda._sleep(spin)  # the engine's device work runs behind
                copies.append(att.page_tables.clone())
                if spin_after:
                    torch.cuda._sleep(spin_after)  # the done event comes late
                att.step_done()
            expected.append(ref.page_tables().numpy().copy())
        stream.synchronize()
        for i, (copy, tables) in enumerate(zip(copies, expected, strict=True)):
            assert np.array_equal(copy.cpu().numpy(), tables), f"step {i}"
        # The tables changed at most steps: a copy of an earlier or later step would differ.
        assert len({t.tobytes() for t in expected}) > steps // 2


@pytest.mark.parametrize("null_page", [False, True])
def test_random_steps_read_their_own_tables(tmp_path: Path, null_page: bool) -> None:
    _run(tmp_path, steps=200, spin=0, seed=7 + null_page, null_page=null_page)


def test_decode_steps_read_their_own_tables(tmp_path: Path) -> None:
    """Pure decode steps (the service's ``decode_step``) between the general steps, with a
    late engine stream, so that several decode steps' edits queue behind its reads."""
    _run(tmp_path, steps=120, spin=SPIN_CYCLES // 5, seed=9, null_page=True, decode=True)


def test_without_the_c_core_steps_read_their_own_tables(tmp_path: Path) -> None:
    """The service's Python paths (no C core): the edits' launch and the step event by
    ``StepLaunch`` and ``StepOrder.record``, decode frames through the general step."""
    _run(
        tmp_path,
        steps=80,
        spin=SPIN_CYCLES // 5,
        seed=13,
        null_page=False,
        decode=True,
        native=False,
    )


def test_a_late_engine_stream_still_reads_its_step(tmp_path: Path) -> None:
    """The hazard: each copy runs about 5 ms after the host sent the step, so the service
    answers the next steps long before the engine's device reads this one's tables."""
    _run(tmp_path, steps=60, spin=SPIN_CYCLES, seed=3, null_page=False)


def test_a_late_engine_reads_its_step_between_steps_not_stream_ordered(tmp_path: Path) -> None:
    """A late engine (its done event 5 ms after its read), with a step every third that is
    not stream-ordered: the service's edits of that step wait for the done event, and the
    engine's next read, queued behind the same done event, must wait for them too (the
    event those steps record), not race them."""
    _run(tmp_path, steps=60, spin=0, seed=5, null_page=False, mixed=True, spin_after=SPIN_CYCLES)


def test_refusals_on_a_cuda_service(tmp_path: Path) -> None:
    """A done event that is not a handle, and ragged layers with the mode: refused, no
    consumer and no step ran."""
    pytest.importorskip("cupy")
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(CONFIG | {"device": "cuda:0", "share": True}))
    with serve_process("--config", str(path)) as (url, _, _), KVCacheClient(url) as kv:
        layout = kv.pools()
        assert layout.step_event is not None
        assert len(base64.b64decode(layout.step_event)) == 64
        body = {"pid": 1, "generation": layout.generation, "done_event": "AAAA"}
        answer = httpx.post(f"{url}/v1/consumers", json=body)
        assert answer.status_code == 422 and answer.json()["code"] == "invalid_argument"
        assert kv.consumers() == []
        h = kv.step_columns(allocate=[{"request_id": "a", "num_tokens": 5}]).handles[0]
        with pytest.raises(InvalidArgument, match="ragged_layers"):
            kv.step_columns(extend=[h], stream_ordered=True, ragged_layers=[0])
        assert kv.request("a").num_tokens == 5
        # Over HTTP the mode answers the mapping too (JSON lists).
        out = kv.step_columns(extend=[h], map_slots=True, stream_ordered=True)
        assert out.ok and [len(g) for g in out.slot_mapping] == [1, 1]
